"""The fuzz harness (tests/fuzz/fuzz_gguf.py): its mutants (metadata, tensor data, truncation) of
both bases (spec random-clover, clover-tiny with its tokenizer and template), the inputs that
once crashed or hung the runtime (tests/data/fuzz/) giving clean errors everywhere, its output
comparison with the unmutated file (a run that differs without a reason is a finding), and a
short campaign with no finding. CI runs the bounded campaign (scripts/test.sh); README
"Fuzzing" has the long one."""

import os
import random

import pytest
from fuzz import fuzz_gguf as F
from testdata import REPO, TINY, VECTORS

from clover_gguf.gguf_io import codec

HINT = "(does the runtime include patches/0005, 0007 and native/? `clover-gguf runtime build` rebuilds it)"


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory, converted):
    """The harness's two bases are the session's default conversions: base_files finds them here."""
    d = tmp_path_factory.mktemp("bases")
    os.link(converted(VECTORS / "random-clover"), d / "base-spec.gguf")
    os.link(converted(TINY), d / "base-tiny.gguf")
    return d


@pytest.fixture(scope="module")
def bases(base_dir):
    return {k: F.load_base(k, p) for k, p in F.base_files(base_dir).items()}


@pytest.fixture(scope="module")
def harness(bases, tmp_path_factory):
    """The CLI, a Python worker, and both bases' unmutated outputs."""
    cli, py = F.find_cli(), F.PythonWorker()
    for b in bases.values():
        F._expected(b, cli, py, 60)
    yield cli, py, tmp_path_factory.mktemp("run")
    py.close()


def test_codec_round_trips_and_mutates(bases):
    for b in bases.values():
        assert codec.serialize(b.g)[0] == b.raw and b.meta_len < len(b.raw)
        assert b.unread, "the base has no general.name/clover_gguf.* values to aim at"
    rng = random.Random(0)
    kinds, changed, same = set(), 0, 0
    for i in range(300):
        b = bases["tiny" if i % 3 == 0 else "spec"]
        m, what, s = F.mutant(rng, b)
        kinds.add(what.split(":")[0].split(" ")[0])
        changed += m != b.raw
        same += s
    assert changed > 270  # a few structured changes happen to write the same value
    assert {"kv", "tensor", "header", "data", "truncate"} <= kinds and any(k.isdigit() for k in kinds)
    assert same > 5  # some mutants touch only what generation never reads


def _with_tensor(b, name: bytes, fill: bytes):
    g = F._copy(b.g)
    ti, old = codec.tensor_data(g, name)
    codec.set_tensor_data(g, name, (fill * (len(old) // len(fill) + 1))[: len(old)])
    return codec.serialize(g)[0]


@pytest.mark.parametrize("fill,want", [(b"\x00\x7e", "clean"), (b"\x7f\x7f", "clean"), (b"\x00\x00", "changed")])
def test_data_mutations_are_refused_or_change_the_output(bases, harness, fill, want):
    """NaN or a huge finite value in all of tiny's output.weight (BF16) is refused by both
    generation targets (non-finite logits); zeros run and give other tokens, for a reason."""
    cli, py, tmp = harness
    tally = F.Tally()
    data = _with_tensor(bases["tiny"], b"output.weight", fill)
    bad = F.check_one(data, "output.weight", cli, py, tally, None, 60, tmp, bases["tiny"], same=False)
    assert bad == [], f"{HINT}: {bad}"
    assert tally.counts["cli"] == {want: 1} and tally.counts["runtime"] == {want: 1}, tally.counts


def test_unread_keys_change_nothing_and_a_difference_is_a_finding(bases, harness):
    """A new general.name must give the base's output (ok); the same output check flags a
    mutant that changed the tokens while claiming to touch nothing generation reads."""
    cli, py, tmp = harness
    b = bases["tiny"]
    g = F._copy(b.g)
    next(kv for kv in g.kvs if kv.key == b"general.name").value = b"another name"
    tally = F.Tally()
    assert F.check_one(codec.serialize(g)[0], "rename", cli, py, tally, None, 60, tmp, b, same=True) == []
    assert tally.counts["cli"] == {"ok": 1} and tally.counts["runtime"] == {"ok": 1}
    data = _with_tensor(b, b"output.weight", b"\x00\x00")
    bad = F.check_one(data, "a claim of no change", cli, py, F.Tally(), None, 60, tmp, b, same=True)
    assert {(t, o) for t, o, _ in bad} == {("cli", "differs"), ("runtime", "differs")}


def test_kept_inputs_replay_clean():
    files = sorted((REPO / "tests" / "data" / "fuzz").glob("*.gguf"))
    assert files, "tests/data/fuzz holds no regression inputs"
    tally = F.replay(REPO / "tests" / "data" / "fuzz", timeout=60)
    assert tally.bad == 0, f"{HINT}: {tally.counts} {tally.findings}"
    assert sum(tally.counts["cli"].values()) == len(files)


def test_short_campaign(tmp_path, base_dir):
    tally = F.campaign(40, seed=12345, keep=tmp_path / "kept", timeout=60, log=lambda *a: None, base_dir=base_dir)
    assert tally.bad == 0, f"{HINT}: {tally.counts} {tally.findings}"
    # the mutants reach every target; the Python side refuses what llama-clover-cli refuses (and
    # may refuse more: on tiny it also renders the chat template, which the CLI does not)
    cli, rt = tally.counts["cli"], tally.counts["runtime"]
    assert rt.get("clean", 0) >= cli.get("clean", 0) > 10 and cli.get("ok", 0) + cli.get("changed", 0) > 0


def test_a_broken_chat_template_is_one_line(bases, tmp_path):
    """Found by the tiny base's first campaign: a byte flip in tokenizer.chat_template made
    CloverRuntime.chat_prompt raise jinja2's TemplateSyntaxError (a traceback in `run --chat`)."""
    from click.testing import CliRunner

    from clover_gguf.cli import cli
    from clover_gguf.runtime.runtime import CloverRuntime, RuntimeError_

    g = F._copy(bases["tiny"].g)
    next(kv for kv in g.kvs if kv.key == b"tokenizer.chat_template").value = b"{% if messages %}{{ & }}"
    p = tmp_path / "t.gguf"
    p.write_bytes(codec.serialize(g)[0])
    rt = CloverRuntime(p, n_threads=1)
    with pytest.raises(RuntimeError_, match="tokenizer.chat_template: the chat template does not render"):
        rt.chat_prompt([{"role": "user", "content": "hi"}])
    rt.close()
    res = CliRunner().invoke(cli, ["run", str(p), "--chat", "-p", "hi", "-n", "4", "-t", "1"])
    assert res.exit_code == 1 and res.stderr.count("\n") == 1 and "TemplateSyntaxError" in res.stderr, res.stderr


@pytest.fixture(scope="module")
def twins(base_dir):
    """Each base's twin (another model of its shapes and tokens): the fingerprint mutants' weights."""
    return F.twin_files(base_dir)


def test_weights_under_the_references_fingerprint_are_refused_by_eval(bases, harness, twins):
    """Issue 47: every fingerprint mutant (the twin's file with the base's fingerprint, one of its
    tensors, a float tensor perturbed, the value edited) is refused by `eval`'s match; generation
    runs or refuses as for any other mutant. A match that accepts one is a finding."""
    cli, py, tmp = harness
    rng = random.Random(2)
    for kind, b in bases.items():
        b = F.Base(b.kind, b.path, b.raw, b.g, b.meta_len, b.unread, b.expected, codec.parse(twins[kind].read_bytes()))
        ops, tally = set(), F.Tally()
        for _ in range(24):
            g = F._copy(b.g)
            what, same = F.mutate_fingerprint(rng, b, g)
            ops.add(what.split(" ")[1] if what.startswith(F.MUST_REFUSE) else what)
            bad = F.check_one(codec.serialize(g)[0], f"{kind}: {what}", cli, py, tally, None, 60, tmp, b, same)
            assert bad == [], f"{HINT}: {what}: {bad}"
        assert ops >= {"another", "tensor"}, ops
        assert set(tally.counts["match"]) == {"clean"}, tally.counts
    bad = F.check_one(b.raw, "tiny: fingerprint: a claim", cli, py, F.Tally(), None, 60, tmp, b)
    assert [(t, o) for t, o, _ in bad] == [("match", "accepted")]


def test_the_new_structural_mutants(bases, harness):
    """A key given twice, token strings that are not UTF-8, the last tensor retyped to a smaller
    type over zeroed bytes: each target refuses in one line (or, llama-clover-cli on the retype,
    runs: ggml and llama.cpp do not check the last tensor's size)."""
    cli, py, tmp = harness
    b = bases["tiny"]

    def run(g, what):
        tally = F.Tally()
        assert F.check_one(codec.serialize(g)[0], what, cli, py, tally, None, 60, tmp, b) == []
        return {t: next(iter(c)) for t, c in tally.counts.items()}

    g = F._copy(b.g)
    kv = next(kv for kv in g.kvs if kv.key == b"clover.block_count")
    g.kvs.append(codec.KV(kv.key, kv.type, kv.value))
    assert set(run(g, "dup").values()) == {"clean"}
    g = F._copy(b.g)
    rng = random.Random(0)
    while F.mutate_tokens(rng, g) != "kv tokenizer.ggml.tokens: invalid UTF-8 (all)":
        g = F._copy(b.g)
    got = run(g, "tokens")
    assert got["cli"] == got["runtime"] == got["match"] == "clean", got
    g = F._copy(b.g)
    ti = max(g.tis, key=lambda t: t.offset)
    assert ti.name == b"output.weight" and ti.type == 30
    ti.type = 8  # Q8_0 over BF16's bytes: 34 where 64 lie
    g.data = g.data[: ti.offset] + bytes(len(g.data) - ti.offset)
    got = run(g, "retype")
    assert got["runtime"] == got["inspect"] == got["match"] == "clean" and got["cli"] == "changed", got
