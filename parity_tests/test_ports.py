"""``mha-parity verify --weights`` and ``mha-parity convert``, and the examples of them in docs/porting.md."""

import json
import pathlib
import shlex

import jax
import numpy as np
import pytest
import torch
from flax import nnx
from flax.serialization import msgpack_serialize
from safetensors.numpy import save_file as save_numpy
from safetensors.torch import load_file as load_torch
from safetensors.torch import save_file as save_torch

import mha_jax
import mha_torch
from parity_tests.tool import cli, harness, ports
from parity_tests.tool.arrays import same_bits

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _section(title: str) -> str:
    text = (ROOT / "docs" / "porting.md").read_text()
    return text.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]


def _blocks(section: str, fence: str) -> list[str]:
    return [b.split("```", 1)[0] for b in section.split(f"```{fence}\n")[1:]]


def test_docs_porting_example_runs(tmp_path, monkeypatch, capsys):
    """The whole example as a user runs it: the Python, then each command (its time is a figure
    in docs/porting.md, measured on a quiet machine, not asserted here)."""
    section = _section("Porting a model: an example")
    (code,) = _blocks(section, "py")
    (shell,) = _blocks(section, "bash")
    commands = [shlex.split(line) for line in shell.splitlines() if line.strip()]
    assert [c[:2] for c in commands] == [["mha-parity", "verify"], ["mha-parity", "convert"]]
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "docs/porting.md", "exec"), {})
    for command in commands:
        assert cli.main(command[1:]) == 0, command
    out = capsys.readouterr().out
    cases = 20 * 3  # every mask form in every dtype
    assert f"{cases} passed, 0 failed" in out and "read back bit for bit in both frameworks" in out
    params = mha_jax.to_torch(tmp_path / "attention.msgpack")
    whole = load_torch(tmp_path / "encoder.safetensors")
    fused = np.concatenate([params[f"{p}.weight"] for p in ("q_proj", "k_proj", "v_proj")])
    assert np.array_equal(fused, whole["layers.0.self_attn.in_proj_weight"].numpy())


def test_docs_source_example_catches_a_wrong_head_count(tmp_path, monkeypatch, capsys):
    """The docs' ``--source encoder_def.py:build``: with --num-heads 8 the port fails against
    the 4-head layer of the model, with 4 it passes."""
    section = _section("Porting a model: an example")
    (definition,) = [b for b in _blocks(section, "") if b.startswith("# encoder_def.py")]
    command = section.split("`mha-parity verify --weights encoder.safetensors --layout torch_mha --num-heads 8", 1)[1]
    command = "verify --weights encoder.safetensors --layout torch_mha --num-heads 8" + command.split("`", 1)[0]
    monkeypatch.chdir(tmp_path)
    (tmp_path / "encoder_def.py").write_text(definition)
    torch.manual_seed(0)
    exec(compile(definition + "\nfrom safetensors.torch import save_file\n"
                              "save_file(build().state_dict(), 'encoder.safetensors')",
                 "docs/porting.md", "exec"), {})
    fast = ["--dtype", "float32", "--mask", "padding", "--workers", "1"]
    assert cli.main(shlex.split(command) + fast) == 1
    assert "torch.nn.MultiheadAttention (4 heads) from --source encoder_def.py:build" in capsys.readouterr().out
    assert cli.main(shlex.split(command.replace("--num-heads 8", "--num-heads 4")) + fast) == 0


def _hf_gqa_file(path, dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    """A Llama-style (q_proj/k_proj/v_proj/o_proj) grouped-query checkpoint: 4 heads, 2 kv heads."""
    module = mha_torch.MultiHeadAttention(12, 4, num_kv_heads=2, kdim=10, vdim=10, dtype=dtype)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(generator=torch.Generator().manual_seed(p.numel()))
    state = {k.replace("out_proj", "o_proj"): v for k, v in module.state_dict().items()}
    save_torch(state, path)
    return module.state_dict()


def test_convert_round_trip_between_layouts_and_frameworks(tmp_path, capsys):
    original = _hf_gqa_file(tmp_path / "hf.safetensors")
    hf = ["--layout", "hf", "--num-heads", "4", "--num-kv-heads", "2"]
    assert cli.main(["convert", str(tmp_path / "hf.safetensors"), str(tmp_path / "a.msgpack"), "--to", "flax",
                     *hf]) == 0
    assert cli.main(["convert", str(tmp_path / "a.msgpack"), str(tmp_path / "b.safetensors"), "--to", "torch"]) == 0
    assert cli.main(["convert", str(tmp_path / "b.safetensors"), str(tmp_path / "c.safetensors"), "--to", "flax",
                     "--num-heads", "4", "--num-kv-heads", "2"]) == 0
    assert "bit for bit" in capsys.readouterr().out
    back = load_torch(tmp_path / "b.safetensors")
    assert set(back) == set(original)
    assert all(same_bits(original[k], back[k]) for k in original)
    flax_names = mha_jax.to_torch(tmp_path / "c.safetensors")  # Flax names, dot-joined
    assert all(same_bits(original[k], flax_names[k]) for k in original)


def test_convert_refuses_to_overwrite_unless_forced(tmp_path, capsys):
    _hf_gqa_file(tmp_path / "hf.safetensors")
    out = tmp_path / "out.safetensors"
    out.write_bytes(b"keep me")
    args = ["convert", str(tmp_path / "hf.safetensors"), str(out), "--to", "torch", "--layout", "hf",
            "--num-heads", "4", "--num-kv-heads", "2"]
    assert cli.main(args) == 2 and out.read_bytes() == b"keep me"
    assert "exists; pass --force to overwrite it" in capsys.readouterr().err
    assert cli.main(args + ["--force"]) == 0 and out.read_bytes() != b"keep me"
    assert cli.main(args[:2] + [str(tmp_path / "out.pt")] + args[3:]) == 2
    assert "--to torch writes a .safetensors file" in capsys.readouterr().err


def _truncating(*args, **kwargs):
    """A writer ``(what, path)`` (safetensors' ``save_file``, a figure's ``savefig``) that stops
    halfway, as a full disk leaves a file."""
    pathlib.Path(args[1]).write_bytes(b"half a fi")
    raise OSError(28, "No space left on device")


@pytest.mark.parametrize("to, name", [("torch", "out.safetensors"), ("flax", "out.msgpack")])
def test_a_failed_conversion_leaves_out_as_it_was(tmp_path, monkeypatch, capsys, to, name):
    """``convert --force`` over an existing OUT whose read-back fails, whose writer raises, or
    which is interrupted: OUT keeps its bytes (or is not made) and no temporary file is left; a
    conversion that succeeds replaces OUT, keeping its permissions."""
    from parity_tests.tool import ports

    _hf_gqa_file(tmp_path / "hf.safetensors")
    out = tmp_path / name
    out.write_bytes(b"keep me")
    out.chmod(0o640)
    args = ["convert", str(tmp_path / "hf.safetensors"), str(out), "--to", to, "--layout", "hf", "--num-heads", "4",
            "--num-kv-heads", "2", "--force"]

    def left():
        assert out.read_bytes() == b"keep me" and sorted(p.name for p in tmp_path.iterdir()) == ["hf.safetensors", name]

    with monkeypatch.context() as m:  # the read-back finds other bits
        m.setattr(ports, "same_bits", lambda a, b: False)
        assert cli.main(args) == 1
    err = capsys.readouterr().err
    assert "holds different values for q_proj.weight after loading" in err and f"{out} is left as it was" in err
    left()
    import flax.serialization
    import safetensors.numpy
    writer = (safetensors.numpy, "save_file") if to == "torch" else (flax.serialization, "msgpack_serialize")
    with monkeypatch.context() as m:
        if to == "torch":
            m.setattr(*writer, _truncating)
        else:
            m.setattr(*writer, lambda params: (_ for _ in ()).throw(OSError(28, "No space left on device")))
        assert cli.main(args) == 2
        assert "No space left on device" in capsys.readouterr().err
        left()
        out.unlink()
        assert cli.main(args) == 2 and sorted(p.name for p in tmp_path.iterdir()) == ["hf.safetensors"]  # no OUT made
        out.write_bytes(b"keep me")
        out.chmod(0o640)
        m.setattr(*writer, lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt()))
        with pytest.raises(KeyboardInterrupt):
            cli.main(args)
        left()
    assert cli.main(args) == 0 and out.read_bytes() != b"keep me" and out.stat().st_mode & 0o777 == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf.safetensors", name]


def test_failed_report_writes_leave_the_old_reports(tmp_path, monkeypatch):
    """``--json`` and ``--report`` files (and a report's plots): a write that fails its
    byte-for-byte read-back or whose writer raises leaves each file as it was and no temporary
    file."""
    from parity_tests.tool import files, report

    save_numpy(mha_jax.to_torch(mha_jax.MultiHeadAttention(4, 16, rngs=nnx.Rngs(0))), tmp_path / "w.safetensors")
    olds = {"r.json": b"old json", "r.md": b"old report", "r-float32.png": b"old plot"}
    for name, data in olds.items():
        (tmp_path / name).write_bytes(data)
    real_write_bytes = pathlib.Path.write_bytes

    def left():
        assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.name != "w.safetensors"} == olds

    case = harness.Case(harness.CONFIGS["self"], "padding", "float32")
    result = harness.Result(case, {"jax vs torch": {"out": {"rel": 2e-6, "max_abs": 1e-7, "abs": 3e-7}}})
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)  # the Markdown alone
    with monkeypatch.context() as m:  # every text file written one byte short: its read-back fails
        m.setattr(pathlib.Path, "write_bytes", lambda self, data: real_write_bytes(self, data[:-1]))
        args = ["verify", "--weights", str(tmp_path / "w.safetensors"), "--num-heads", "4", "--dtype", "float32",
                "--mask", "none"]
        assert cli.main(args + ["--json", str(tmp_path / "r.json")]) == 2
        left()
        with pytest.raises(OSError, match="does not read back as written"):
            report.write_markdown(str(tmp_path / "r.md"), report.Header("a title", ["a"], "shapes", 3), [result])
        left()
    with pytest.raises(OSError, match="No space left on device"):  # a plot's writer (a figure's savefig) stops halfway
        files.write_atomically(str(tmp_path / "r-float32.png"), lambda path: _truncating(None, path))
    left()
    report.write_markdown(str(tmp_path / "r.md"), report.Header("a title", ["a"], "shapes", 3), [result])
    assert "a title" in (tmp_path / "r.md").read_text() and len(list(tmp_path.iterdir())) == 4


def test_verify_weights_reads_flax_heads_from_the_kernels(tmp_path):
    model = nnx.MultiHeadAttention(4, 16, 24, 12, num_kv_heads=2, decode=False,
                                   bias_init=nnx.initializers.normal(0.5), rngs=nnx.Rngs(0))
    path = tmp_path / "flax.msgpack"
    path.write_bytes(msgpack_serialize(nnx.to_pure_dict(nnx.state(model, nnx.Param))))
    report = tmp_path / "report.json"
    code = cli.main(["verify", "--weights", str(path), "--dtype", "float32", "--mask", "padding+causal",
                     "--json", str(report)])
    result = json.loads(report.read_text())
    assert code == 0 and result["passed"] and [c["case"] for c in result["cases"]] == ["weights/padding+causal/float32"]
    config = result["cases"][0]["config"]
    assert (config["num_heads"], config["num_kv_heads"], config["qkv_features"],
            config["out_features"]) == (4, 2, 24, 12)
    assert "num_heads 4, num_kv_heads 2" in result["weights"]


@pytest.mark.parametrize("args, message", [
    (["--layout", "hf"], "--num-heads is needed"),
    (["--layout", "bert", "--num-heads", "4", "--num-kv-heads", "2"], "missing key 'self.query.weight'"),
    (["--layout", "hf", "--num-heads", "5"], "no head_dim fits --num-heads 5 and --num-kv-heads 5"),
    (["--num-heads", "4", "--num-kv-heads", "4"], "the file (--layout 'hf'): 'k_proj.weight' has shape (6, 10), "
                                                  "expected (12, 10) (--num-kv-heads 4 x head_dim=3 rows)"),
    (["--layout", "flax"], "--layout flax: {path} holds no Flax parameter names (query.kernel, ...) "
                           "but 'k_proj.bias', "),
])
def test_verify_weights_names_what_does_not_fit(tmp_path, capsys, args, message):
    _hf_gqa_file(tmp_path / "hf.safetensors")
    assert cli.main(["verify", "--weights", str(tmp_path / "hf.safetensors"), *args]) == 2
    assert message.format(path=tmp_path / "hf.safetensors") in capsys.readouterr().err


def test_the_layout_is_read_from_the_keys(tmp_path, capsys):
    """Without --layout, a file's keys say its layout; keys that show none give an error that
    names the likely layouts and every layout there is."""
    original = _hf_gqa_file(tmp_path / "hf.safetensors")
    assert cli.main(["convert", str(tmp_path / "hf.safetensors"), str(tmp_path / "out.safetensors"), "--to", "torch",
                     "--num-heads", "4", "--num-kv-heads", "2"]) == 0
    assert "(layout hf, detected from the keys, bfloat16)" in capsys.readouterr().out
    back = load_torch(tmp_path / "out.safetensors")
    assert all(same_bits(original[k], back[k]) for k in original)
    save_numpy({"h.0.attn.qkv.weight": np.zeros((36, 12), np.float32),
                "h.0.attn.c_proj.weight": np.zeros((12, 12), np.float32)},
               tmp_path / "gpt.safetensors")
    assert cli.main(["convert", str(tmp_path / "gpt.safetensors"), str(tmp_path / "gpt.msgpack"), "--to", "flax",
                     "--num-heads", "4"]) == 2
    err = capsys.readouterr().err
    assert "show no layout" in err and "likely layouts: fused_qkv;" in err
    assert ("give --layout (one of mha_torch, torch_mha, hf, bert, fused_qkv, flax) "
            "or, for another naming scheme, --mapping") in err


def _normalize_qk_files(tmp_path) -> dict[str, np.ndarray]:
    """A flax ``normalize_qk`` layer's msgpack, and the same weights in mha_torch names."""
    model = nnx.MultiHeadAttention(4, 16, num_kv_heads=2, normalize_qk=True, decode=False,
                                   bias_init=nnx.initializers.normal(0.5), rngs=nnx.Rngs(0))
    for ln in (model.query_ln, model.key_ln):
        scale = ln.scale.get_value()
        ln.scale.set_value(scale + 0.25 * jax.random.normal(jax.random.key(1), scale.shape, scale.dtype))
    (tmp_path / "flax.msgpack").write_bytes(msgpack_serialize(nnx.to_pure_dict(nnx.state(model, nnx.Param))))
    state = mha_jax.to_torch(model)
    save_numpy(state, tmp_path / "ours.safetensors")
    return state


def test_normalize_qk_checkpoints_convert_and_verify(tmp_path, capsys):
    """flax's normalize_qk scales (query_ln, key_ln) and ours (q_norm, k_norm) convert both
    ways bit for bit, and verify runs on them (the flax file against flax.nnx.MultiHeadAttention)."""
    state = _normalize_qk_files(tmp_path)
    assert cli.main(["convert", str(tmp_path / "flax.msgpack"), str(tmp_path / "torch.safetensors"),
                     "--to", "torch"]) == 0
    back = load_torch(tmp_path / "torch.safetensors")
    assert set(back) == set(state) and all(same_bits(back[k], state[k]) for k in state)
    assert cli.main(["convert", str(tmp_path / "ours.safetensors"), str(tmp_path / "again.msgpack"), "--to", "flax",
                     "--num-heads", "4", "--num-kv-heads", "2"]) == 0
    again = mha_jax.to_torch(tmp_path / "again.msgpack")
    assert all(same_bits(again[k], state[k]) for k in state)
    assert "normalize_qk" in capsys.readouterr().out
    fast = ["--dtype", "float32", "--mask", "padding", "--workers", "1"]
    assert cli.main(["verify", "--weights", str(tmp_path / "flax.msgpack"), *fast]) == 0
    out = capsys.readouterr().out
    assert "against the source: 1 cases" in out and "with biases, normalize_qk" in out
    assert cli.main(["verify", "--weights", str(tmp_path / "ours.safetensors"), "--num-heads", "4",
                     "--num-kv-heads", "2", *fast]) == 0


def test_verify_weights_fails_when_a_framework_loads_other_values(tmp_path):
    """What each framework holds after loading, one bit off in one tensor: the check names the framework and the
    tensor (``verify --weights`` prints it and exits 1); as loaded, it passes."""
    _hf_gqa_file(tmp_path / "hf.safetensors", torch.float32)
    checkpoint = ports.read(str(tmp_path / "hf.safetensors"), layout="hf", num_heads=4, num_kv_heads=2)
    model, module = ports.build_ours(checkpoint)
    held = {"jax": mha_jax.to_torch(model), "torch": dict(module.state_dict())}
    ports.check_held(checkpoint, held)
    with torch.no_grad():
        module.k_proj.bias[0] = torch.nextafter(module.k_proj.bias[0], torch.tensor(np.inf))
    with pytest.raises(AssertionError, match="torch holds different values for k_proj.bias after loading"):
        ports.check_held(checkpoint, held)
