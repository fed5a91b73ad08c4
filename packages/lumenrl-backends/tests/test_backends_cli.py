"""The `lumenrl` CLI, in-process and as a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lumenrl_backends import cli
from lumenrl_core.plugins import PluginRegistry, set_registry


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lumenrl_backends.cli", *args],
                          capture_output=True, text=True, timeout=timeout)


def has_config_loader() -> bool:
    import lumenrl_core.config as config

    return hasattr(config, "load_config") and hasattr(config, "dump_config")


needs_loader = pytest.mark.skipif(not has_config_loader(), reason="lumenrl_core.config.load_config not landed yet")


class FakeEngine:
    capabilities = frozenset({"fp8_weights", "logprobs"})

    @classmethod
    def probe(cls):
        return None


class FakeGpuEngine:
    capabilities = frozenset()

    @classmethod
    def probe(cls):
        return "no CUDA/ROCm GPU visible to torch"


@pytest.fixture
def isolated_registry():
    reg = PluginRegistry(discover=False)
    reg.register("rollout_engines", "fake", FakeEngine, distribution="lumenrl-test", version="1.0")
    reg.register("rollout_engines", "gpu_only", FakeGpuEngine, distribution="lumenrl-test", version="1.0")
    old = set_registry(reg)
    yield reg
    set_registry(old)


def test_plugins_json_from_isolated_registry(isolated_registry, capsys):
    assert cli.main(["plugins", "--kind", "rollout_engines", "--format", "json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert rows == [
        {"kind": "rollout_engines", "name": "fake", "package": "lumenrl-test 1.0",
         "capabilities": "fp8_weights, logprobs", "requires": "-", "status": "available"},
        {"kind": "rollout_engines", "name": "gpu_only", "package": "lumenrl-test 1.0", "capabilities": "-",
         "requires": "-", "status": "unavailable: no CUDA/ROCm GPU visible to torch"},
    ]


def test_plugins_plain_table(isolated_registry, capsys):
    assert cli.main(["plugins", "--kind", "rollout_engines", "--format", "plain"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["KIND", "NAME", "PACKAGE", "CAPABILITIES", "REQUIRES", "STATUS"]
    assert lines[1].split()[:4] == ["rollout_engines", "fake", "lumenrl-test", "1.0"]
    assert lines[2].endswith("unavailable: no CUDA/ROCm GPU visible to torch")
    assert lines[1].index("lumenrl-test") == lines[2].index("lumenrl-test")  # aligned columns


def test_plugins_table_ends_with_every_package_version(isolated_registry, capsys):
    import importlib.metadata as metadata

    from lumenrl_backends.versions import LUMENRL_DISTRIBUTIONS

    assert cli.main(["plugins", "--format", "plain"]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith("packages: ")
    assert last.removeprefix("packages: ").split(", ") == [
        f"{name} {metadata.version(name)}" for name in LUMENRL_DISTRIBUTIONS]


def test_version_names_every_package(capsys):
    import importlib.metadata as metadata

    with pytest.raises(SystemExit) as exc:
        cli.main(["--version"])
    out = capsys.readouterr().out
    assert exc.value.code == 0 and out.startswith(f"lumenrl {metadata.version('lumenrl-backends')} (")
    assert f"lumenrl-quant {metadata.version('lumenrl-quant')}" in out


def test_no_command_and_bad_kind_exit_2(capsys):
    assert cli.main([]) == 2
    assert "plugins" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        cli.main(["plugins", "--kind", "engines"])
    assert exc.value.code == 2


def test_user_error_is_one_line_without_traceback(monkeypatch, capsys):
    def register_boom(subparsers):
        subparsers.add_parser("boom").set_defaults(func=lambda args: (_ for _ in ()).throw(cli.CLIError("bad thing")))

    monkeypatch.setattr(sys.modules[__name__], "register_boom", register_boom, raising=False)
    monkeypatch.setitem(cli.COMMANDS, "boom", f"{__name__}:register_boom")
    assert cli.main(["boom"]) == 2
    assert capsys.readouterr().err == "lumenrl boom: error: bad thing\n"


def test_missing_command_module_is_skipped(monkeypatch):
    monkeypatch.setitem(cli.COMMANDS, "later", "lumenrl_backends.cli_not_written_yet:register_cli")
    parser = cli.build_parser()
    assert "plugins" in parser.format_help() and "later" not in parser.format_help()


def test_plugins_subprocess_lists_several_packages():
    result = run_cli("plugins", "--format", "json")
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    packages = {row["package"].split()[0] for row in rows}
    assert {"lumenrl-core", "lumenrl-backends", "lumenrl-async", "lumenrl-sddd", "lumenrl-moe"} <= packages
    assert all(row["status"] == "available" or row["status"].startswith("unavailable: ") for row in rows)


def test_console_script_is_installed():
    script = Path(sys.executable).parent / "lumenrl"
    if not script.exists():
        pytest.skip("console script not installed in this environment")
    result = subprocess.run([str(script), "--version"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.startswith("lumenrl ")


@needs_loader
def test_config_show_defaults_and_overrides(capsys):
    assert cli.main(["config", "show", "policy.rollout_engine=hf", "seed=7"]) == 0
    out = capsys.readouterr().out
    assert "rollout_engine: hf" in out and "seed: 7" in out


@needs_loader
def test_config_show_from_file(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text("policy:\n  rollout_engine: hf\nnum_training_steps: 3\n")
    assert cli.main(["config", "show", "--config", str(path), "num_training_steps=5"]) == 0
    out = capsys.readouterr().out
    assert "rollout_engine: hf" in out and "num_training_steps: 5" in out


@needs_loader
def test_config_error_is_one_line_exit_2_subprocess():
    result = run_cli("config", "show", "policy.modle_name=x")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert result.stderr.startswith("lumenrl config: error:") and "policy.modle_name" in result.stderr


@needs_loader
def test_config_check_resolves_real_plugins(capsys):
    assert cli.main(["config", "check", "policy.rollout_engine=hf"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:2] == ["training_backend", "fsdp2"] and "(lumenrl-backends" in out[0]
    assert out[1].split()[:2] == ["rollout_engine", "hf"]
    assert out[-1].startswith("ok: assembly policy strict, 0 warning(s)")


@needs_loader
def test_config_check_reports_all_violations_exit_2(capsys):
    code = cli.main(["config", "check", "policy.rollout_engine=nope", "quantization.training.precision=mxfp4"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert err.startswith("lumenrl config: error: run config rejected by assembly (2 problem(s)):")
    assert "  - quantization.training.precision='mxfp4': not supported for training" in err
    assert "  - policy.rollout_engine='nope': no rollout_engines plugin named 'nope'" in err


@needs_loader
def test_config_check_lenient_prints_warnings(capsys):
    args = ["config", "check", "assembly.strict_policy=false", "quantization.training.precision=mxfp4"]
    assert cli.main(args) == 0
    captured = capsys.readouterr()
    assert captured.err.startswith("warning: quantization.training.precision='mxfp4'")
    assert captured.out.splitlines()[-1] == "ok: assembly policy lenient, 1 warning(s)"
