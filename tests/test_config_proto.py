import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.daemon.config import load_config
from kvstore.user_input import parse_size

ROOT = Path(__file__).resolve().parent.parent


def test_grpc_stubs_are_fresh():
    result = subprocess.run([sys.executable, "scripts/gen_proto.py", "--check"], cwd=ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_precedence_file_then_environment_then_flags(tmp_path):
    file = tmp_path / "kvstore.toml"
    file.write_text('cpu_capacity = "3GiB"\ndisk_capacity = "20GiB"\nwrite_policy = "write-back"\n')
    config = load_config(file, overrides={"disk_capacity": "5GiB"},
                         environ={"KVSTORE_CPU_CAPACITY": "1GiB", "KVSTORE_DISK_FSYNC": "false"})
    assert config.cpu_capacity == 2**30            # env beats file
    assert config.disk_capacity == 5 * 2**30       # flag beats env and file
    assert config.write_policy == "write-back"     # file beats default
    assert config.disk_fsync is False


@pytest.mark.parametrize("overrides, words", [
    ({"write_policy": "sometimes"}, "write_policy"),
    ({"cpu_capacity": "lots"}, "not a size"),
    ({"listen": "0.0.0.0:5000"}, "auth_token"),
    ({"cpu_capacity": "0", "disk_path": ""}, "no tier"),
    ({"disk_fsync": "maybe"}, "boolean"),
])
def test_bad_settings_say_what_to_fix(overrides, words):
    with pytest.raises(ValueError, match=words):
        load_config(overrides=overrides, environ={})


def test_unknown_file_keys_are_refused(tmp_path):
    file = tmp_path / "kvstore.toml"
    file.write_text("cpu_size = 5\n")
    with pytest.raises(ValueError, match="unknown keys"):
        load_config(file, environ={})


def test_sizes():
    assert parse_size("2GiB") == 2 * 2**30 and parse_size("1.5MB") == 1_500_000 and parse_size(42) == 42


def test_cli_help_explains():
    out = subprocess.run([sys.executable, "-m", "kvstore.cli", "serve", "--help"], capture_output=True,
                         text=True, check=True).stdout
    assert "KVSTORE_CPU_CAPACITY" in out and "unix:" in out
