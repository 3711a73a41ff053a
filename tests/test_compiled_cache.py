"""The compile cache folder (runners/compile_cache.py; docs/security.md, "The compile cache"): created
0700, refused when another user could write into it or replace it (the folder, a parent that is not
sticky, an owner that is neither the server's user nor root, another user's symbolic link), the
private default, and the server's exit in one line naming compile_cache_dir. Torch is never imported."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from lerobot_zenoh.errors import ConfigError
from lerobot_zenoh.server.runners.compile_cache import (
    CACHE_ENVIRONMENT,
    REMOTE_CACHES_OFF,
    check_folder,
    default_folder,
    use_folder,
)

ME = os.geteuid()
OTHER = 54321  # a uid no test file belongs to
as_root = pytest.mark.skipif(ME != 0, reason="changing a folder's owner needs root")


@pytest.fixture(autouse=True)
def _environment(monkeypatch):
    """use_folder writes the process environment: restored after each test."""
    for name in (*CACHE_ENVIRONMENT, *REMOTE_CACHES_OFF):
        monkeypatch.setenv(name, "unset")


def mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def refused(folder: Path, needle: str, uid: int = ME) -> str:
    with pytest.raises(ConfigError) as err:
        check_folder(folder, uid=uid)
    text = str(err.value)
    assert err.value.field == "compile_cache_dir" and needle in text and "\n" not in text, text
    return text


def test_a_new_folder_and_its_new_parents_are_created_0700_whatever_the_umask(tmp_path):
    old = os.umask(0)
    try:
        folder = tmp_path / "a" / "b" / "cache"
        assert use_folder(folder) == folder
    finally:
        os.umask(old)
    assert [mode(p) for p in (tmp_path / "a", tmp_path / "a" / "b", folder)] == [0o700] * 3
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(folder)
    assert os.environ["TRITON_CACHE_DIR"] == str(folder / "triton")
    assert os.environ["TRITON_OVERRIDE_DIR"] == str(folder / "triton-override")
    assert os.environ["TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE"] == os.environ["TORCHINDUCTOR_AUTOGRAD_REMOTE_CACHE"] == "0"
    use_folder(folder)  # again, as a restart does: the folder is kept


def test_a_folder_others_can_write_is_refused_even_with_the_sticky_bit(tmp_path):
    folder = tmp_path / "cache"
    for bits in (0o770, 0o707, 0o1777, 0o775):
        folder.mkdir(exist_ok=True)
        os.chmod(folder, bits)
        refused(folder, f"writable by other users (mode {bits:04o})")
    os.chmod(folder, 0o755)  # readable by others is no way in
    check_folder(folder, uid=ME)


def test_a_parent_others_can_write_is_refused_unless_sticky(tmp_path):
    parent = tmp_path / "shared"
    parent.mkdir()
    folder = parent / "cache"
    folder.mkdir(mode=0o700)
    for bits in (0o777, 0o775, 0o757):
        os.chmod(parent, bits)
        refused(folder, f"{parent}, is writable by other users without the sticky bit")
    os.chmod(parent, 0o1777)  # like /tmp: others may add entries, not rename or remove ours
    check_folder(folder, uid=ME)
    os.chmod(parent, 0o755)


def test_folders_the_server_creates_below_a_sticky_tmp_are_accepted(tmp_path):
    sticky = tmp_path / "tmp"
    sticky.mkdir()
    os.chmod(sticky, 0o1777)
    check_folder(sticky / "lz" / "inductor", uid=ME)
    assert mode(sticky / "lz") == mode(sticky / "lz" / "inductor") == 0o700


@as_root
def test_a_folder_or_a_parent_owned_by_another_user_is_refused_and_roots_parents_are_fine(tmp_path):
    folder = tmp_path / "theirs"
    folder.mkdir(mode=0o700)
    os.chown(folder, OTHER, OTHER)
    refused(folder, f"owned by uid {OTHER}, not by the server's user")
    # A parent owned by another user (even 0755): they could rename the cache folder away.
    parent = tmp_path / "home"
    (parent / "cache").mkdir(parents=True, mode=0o700)
    os.chmod(parent, 0o755)
    os.chown(parent, OTHER, OTHER)
    refused(parent / "cache", f"{parent}, is owned by uid {OTHER}")
    # The server as an ordinary user (uid OTHER): its own folder below root-owned parents is accepted,
    # the root-owned folder itself is not its own.
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    os.chown(mine, OTHER, OTHER)
    check_folder(mine, uid=OTHER)
    refused(tmp_path, "owned by uid 0, not by the server's user", uid=OTHER)


@as_root
def test_another_users_symbolic_link_on_the_way_is_refused(tmp_path):
    target = tmp_path / "real"
    target.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(target)
    check_folder(link, uid=ME)  # our own link to our own folder
    link.unlink()
    link.symlink_to(target)
    os.lchown(link, OTHER, OTHER)
    refused(link, "is a symbolic link owned by uid")


def test_without_compile_cache_dir_the_server_uses_its_own_private_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_folder() == tmp_path / "xdg" / "lerobot-zenoh" / "inductor"
    folder = use_folder(None)
    assert folder == default_folder() and mode(folder) == 0o700
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(folder)
    assert not os.environ["TORCHINDUCTOR_CACHE_DIR"].startswith("/tmp/torchinductor_")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_folder() == Path.home() / ".cache" / "lerobot-zenoh" / "inductor"


def test_a_compiled_model_without_the_field_gets_the_private_folder_before_loading(tmp_path, monkeypatch):
    from lerobot_zenoh.errors import PolicyError
    from lerobot_zenoh.server.config.manifest import parse_manifest
    from lerobot_zenoh.server.config.runner_loading import load_runner

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    m = parse_manifest({"cluster_uuid": "c", "experiment_tag": "e",
                        "server": [{"model_id": "m", "model_version": "v", "application_tag": "a",
                                    "pretrained_path": str(tmp_path / "missing"), "accept_unknown_clients": True,
                                    "compile": "default"}]})
    with pytest.raises(PolicyError):  # no checkpoint there; the folder was set before loading
        load_runner(m, m.server[0])
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "xdg" / "lerobot-zenoh" / "inductor")


@pytest.mark.slow
def test_the_server_refuses_to_start_in_one_line_naming_compile_cache_dir(tmp_path, port):
    import yaml

    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    (shared / "inductor").mkdir()
    manifest = tmp_path / "m.yaml"
    manifest.write_text(yaml.safe_dump({
        "cluster_uuid": "c", "experiment_tag": "e", "compile_cache_dir": str(shared / "inductor"),
        "zenoh": {"mode": "peer", "listen": [f"tcp/127.0.0.1:{port}"], "multicast_scouting": False},
        "server": [{"model_id": "m", "model_version": "v", "application_tag": "a", "accept_unknown_clients": True,
                    "pretrained_path": str(tmp_path / "missing"), "compile": "default"}]}))
    out = subprocess.run([sys.executable, "-m", "lerobot_zenoh.cli.server", f"--manifest={manifest}"],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 2, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert "compile_cache_dir" in last and "without the sticky bit" in last, out.stderr
