import hashlib
import json
from pathlib import Path

import pytest
from testdata import VECTORS


@pytest.fixture(scope="session")
def vectors():
    assert (VECTORS / "vectors.json").exists(), f"spec test vectors not found at {VECTORS}"
    return json.loads((VECTORS / "vectors.json").read_text())["cases"]


@pytest.fixture(scope="session")
def vec_dir():
    return VECTORS / "random-clover"


@pytest.fixture(scope="session")
def vec_fused_dir():
    return VECTORS / "random-clover-fused"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="session")
def converted(tmp_path_factory):
    """converted(model, recipe=None) -> the GGUF of that model folder with that recipe (None: the
    converter's default), made once per session and shared by every test that asks for the same
    pair: a test that needs a GGUF, not one that tests the converter. Read it, never write it
    (copy it first); the session fails at its end if one changed."""
    from clover_gguf.convert.converter import convert

    made: dict[tuple[Path, str | None], tuple[Path, str]] = {}

    def get(model: Path, recipe: str | None = None) -> Path:
        key = (Path(model).resolve(), recipe)
        if key not in made:
            out = tmp_path_factory.mktemp("converted") / f"{key[0].name}-{recipe or 'default'}.gguf"
            convert(key[0], out, recipe=recipe, progress=False)
            made[key] = (out, _sha256(out))
        return made[key][0]

    yield get
    changed = [str(p) for p, digest in made.values() if _sha256(p) != digest]
    assert not changed, f"a test wrote a shared conversion (copy it first): {', '.join(changed)}"


def pytest_configure(config):
    # The test models are tiny: one thread is fastest and immune to oversubscription.
    import torch

    torch.set_num_threads(1)


# The tests that need the built llama.cpp runtime (`clover-gguf runtime build`): whole folders
# and files, and single tests of files that are otherwise pure Python. `pytest -m "not runtime"`
# is the fast lane: it runs without the build.
RUNTIME_PATHS = (
    "tests/runtime/",
    "tests/serve/",
    "tests/test_quickstart.py",
    "tests/convert/test_llama_quantize.py",
    "tests/convert/test_upstream_convert.py",
    "tests/plan/test_runtime_flags.py",
)
RUNTIME_TESTS = (
    "tests/eval/test_eval_quality.py::test_runtime_provider_matches_reference_on_f32_weights",
    "tests/eval/test_eval_memory.py::test_run_on_clover_tiny_v3",
    "tests/plan/test_placement.py::test_run_cpu_build_says_nothing_to_fit",
    "tests/plan/test_placement.py::test_llama_clover_cli_fit",
    "tests/plan/test_plan.py::test_run_override_tensor",
    "tests/test_cli_errors.py::test_run_inputs[gguf-",
    "tests/test_cli_errors.py::test_run_missing_gguf_and_folder",
    "tests/test_options.py::test_block_size_1024_runs_on_a_gguf",
    "tests/test_options.py::test_run_adds_bos_as_the_gguf_says_like_llama_clover_cli",
    "tests/test_nonfinite.py::test_gguf_run_stops_naming_the_tensor",
    "tests/test_nonfinite.py::test_runtime_python_loop_and_batch",
    "tests/test_nonfinite.py::test_healthy_model_debug_pass_finds_nothing",
    "tests/test_nonfinite.py::test_one_minus_inf_logit_stops_generation",
    "tests/test_inputs.py::test_llama_clover_cli_refuses_a_fifo",
    "tests/test_messages.py::test_run_under_an_address_space_limit",
)


def pytest_collection_modifyitems(config, items):
    import pytest

    for item in items:
        nid = item.nodeid
        if nid.startswith(RUNTIME_PATHS) or nid.startswith(RUNTIME_TESTS):
            item.add_marker(pytest.mark.runtime)
