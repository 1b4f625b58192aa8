#include "clover-grammar.h"

#include "json-schema-to-grammar.h"

#include <algorithm>
#include <cstring>
#include <exception>
#include <string>

int32_t clover_json_schema_to_grammar(const char * schema, char * out, size_t n_out) {
    std::string res;
    bool ok = false;
    try {
        res = json_schema_to_grammar(common_json::parse(schema ? schema : ""), /*force_gbnf*/ true);
        ok  = true;
    } catch (const std::exception & e) {
        res = e.what();
    } catch (...) {
        res = "unknown error";
    }
    if (res.size() > INT32_MAX - 1) {
        res = "the grammar is too large";
        ok  = false;
    }
    if (out && n_out > 0) {
        const size_t n = std::min(res.size(), n_out - 1);
        memcpy(out, res.data(), n);
        out[n] = '\0';
    }
    const int32_t n = (int32_t) res.size();
    return ok ? n : -std::max(1, n);
}
