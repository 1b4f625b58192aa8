#pragma once

// A C entry point to common's JSON-schema-to-grammar converter, for callers that are not C++
// (clover-gguf's server loads it with ctypes) and for llama-clover-cli --json-schema.

#include <stddef.h>
#include <stdint.h>

#if defined(_WIN32) && defined(CLOVER_BUILD)
#    define CLOVER_GRAMMAR_API __declspec(dllexport)
#elif defined(_WIN32)
#    define CLOVER_GRAMMAR_API __declspec(dllimport)
#else
#    define CLOVER_GRAMMAR_API __attribute__((visibility("default")))
#endif

#ifdef __cplusplus
extern "C" {
#endif

// Convert a JSON schema (text) to a GBNF grammar whose root rule is `root`. On success returns
// the grammar's length and copies it, NUL-terminated, into out when n_out > that length. On
// failure returns -(length of the error message) and copies the message likewise.
CLOVER_GRAMMAR_API int32_t clover_json_schema_to_grammar(const char * schema, char * out, size_t n_out);

#ifdef __cplusplus
}
#endif
