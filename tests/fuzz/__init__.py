"""The fuzz harnesses: mutated GGUF files against the loaders (fuzz_gguf.py) and mutated requests
against `clover-gguf serve` (fuzz_server.py). The tests import them as `fuzz.fuzz_gguf` and
`fuzz.fuzz_server` (tests/ is on pytest's path); the long campaigns run them as commands:
`python tests/fuzz/fuzz_gguf.py --help`, `python tests/fuzz/fuzz_server.py --help`."""
