"""The console scripts as a user meets them before anything heavy runs: mistakes reported without
importing LeRobot or torch (the import graph is checked, not the clock; docs/client.md has the times
measured), every script in a core install (`pip install .`) working or naming its extra, hub ids
resolved offline from a Hugging Face cache in a temporary HF_HOME, and what make demo prints."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: Prints, after the script ran, whether torch or LeRobot were imported (atexit runs after SystemExit).
PROBE = """
import atexit, runpy, sys
atexit.register(lambda: print("IMPORTED", sorted(m for m in ("torch", "lerobot") if m in sys.modules), file=sys.stderr))
sys.argv = [sys.argv[1], *sys.argv[2:]]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""


def probe(module: str, args: list[str], env: dict | None = None, cwd: Path = ROOT) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Run `python -m module args`; (its result without the probe's line, the heavy modules it imported)."""
    result = subprocess.run([sys.executable, "-c", PROBE, module, *args], capture_output=True, text=True, timeout=120,
                            cwd=cwd, env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), **(env or {})})
    lines = result.stderr.splitlines()
    imported = [line for line in lines if line.startswith("IMPORTED ")]
    assert imported, result.stderr[-2000:]
    stderr = "\n".join(line for line in lines if not line.startswith("IMPORTED ")) + "\n"
    return (subprocess.CompletedProcess(result.args, result.returncode, result.stdout, stderr),
            eval(imported[-1].removeprefix("IMPORTED ")))  # noqa: S307 - our own repr of a list of names


def one_line(result: subprocess.CompletedProcess, code: int, *needles: str) -> None:
    """Exit `code` and one line naming `needles` (after the progress log lines, INFO)."""
    import re

    info = re.compile(r"^\d{4}-\d\d-\d\d [\d:,]+ INFO ")
    lines = [line for line in result.stderr.splitlines() if line.strip() and not info.match(line)]
    assert result.returncode == code and len(lines) == 1, (result.returncode, result.stderr[-2000:])
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def dead_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SIM = "--robot.type=zenoh_sim"
CLIENT = "lerobot_zenoh.cli.client"

# (arguments, exit code, what the one line names): each reported before LeRobot or torch is imported.
FAST_CLIENT_MISTAKES = [
    ([SIM, "--fps=abc"], 2, ["--fps", "'abc'"]),
    ([SIM, "--fps=0"], 2, ["--fps: must be in 1..1000"]),
    ([], 2, ["missing required flag --robot.type"]),
    (["--robot.type=so101_folower"], 2, ["--robot.type: 'so101_folower'", "did you mean so101_follower?"]),
    ([SIM, "--num_episodes=2"], 2, ["unknown flag --num_episodes=2"]),
    ([SIM, "--failsafe=stop"], 2, ["--failsafe", "'stop'"]),
    (["--robot.type", "so101_follower", "--robot.port", "/dev/ttyACM_not_there"], 2,
     ["--robot.port: /dev/ttyACM_not_there does not exist"]),
    ([SIM, "--dataset.repo_id=nouser"], 2, ["--dataset.repo_id", "<user>/<name>"]),
    ([SIM, "--dataset.repo_id=local/x", "--dataset.root=/sys/lerobot_zenoh_test/ds"], 2,
     ["--dataset.root: cannot write under /sys"]),
    ([SIM, "--resume=true"], 2, ["--resume: needs --dataset.repo_id"]),
    ([SIM, "--endpoint=127.0.0.1:{dead}"], 3, ["cannot connect to tcp/127.0.0.1:{dead}: nothing answers there"]),
    ([SIM, "--zenoh.connect=tcp/127.0.0.1:{dead}"], 3, ["cannot connect to tcp/127.0.0.1:{dead}: nothing answers there"]),
    ([SIM, "--task=" + "x" * 3000], 2, ["--task: is 3000 bytes of UTF-8; a server reads at most 2048"]),
    ([SIM, "--dataset.repo_id=local/x", "--dataset.single_task=" + "ü" * 1100], 2,
     ["--dataset.single_task: is 2200 bytes"]),
    # LeRobot async-inference flags: answered with what does the same here.
    ([SIM, "--pretrained_name_or_path=lerobot/smolvla_base"], 2,
     ["the model is chosen on the server: lerobot-policy-server --policy.path=lerobot/smolvla_base"]),
    ([SIM, "--policy_type", "smolvla"], 2, ["--policy_type: the server reads the policy type from the checkpoint"]),
    ([SIM, "--policy_device=mps"], 2, ["lerobot-policy-server --policy.device=mps"]),
    ([SIM, "--chunk_size_threshold=0.5"], 2, ["--chunk_size_threshold:", "--send.buffer_time_s="]),
    ([SIM, "--aggregate_fn_name=latest_only"], 2, ["--aggregate.type=latest_only"]),
]

#: LeRobot's policy-server flags, answered by lerobot-policy-server before anything is loaded.
FAST_SERVER_MISTAKES = [
    (["--host=0.0.0.0", "--port=8080"], ["--host: the server listens on a Zenoh endpoint: --endpoint=tcp/0.0.0.0:8080"]),
    (["--port", "9000"], ["--port:", "--endpoint=tcp/0.0.0.0:9000"]),
]


@pytest.mark.parametrize("args,needles", FAST_SERVER_MISTAKES, ids=[" ".join(c[0]) for c in FAST_SERVER_MISTAKES])
def test_lerobot_policy_server_flags_are_answered_with_the_endpoint(args, needles):
    result, imported = probe("lerobot_zenoh.cli.server", args)
    one_line(result, 2, *needles)
    assert imported == [], imported


@pytest.mark.parametrize("args,code,needles", FAST_CLIENT_MISTAKES, ids=[" ".join(c[0]) or "none" for c in FAST_CLIENT_MISTAKES])
def test_a_client_mistake_is_one_line_before_lerobot_or_torch_is_imported(args, code, needles):
    port = dead_port()
    result, imported = probe(CLIENT, [a.format(dead=port) for a in args])
    one_line(result, code, *(n.format(dead=port) for n in needles))
    assert imported == [], imported


def test_a_wrong_model_id_is_found_before_lerobot_is_imported(port, app_key):
    from lz_testing import make_server

    with make_server(port, app_key):
        result, imported = probe(CLIENT, [SIM, f"--endpoint=127.0.0.1:{port}", "--model_id=smolvla"])
    errors = [line for line in result.stderr.splitlines() if " ERROR " in line]
    assert result.returncode == 3 and len(errors) == 1, result.stderr[-2000:]
    assert "does not serve --model_id=smolvla; it serves: " + app_key.prefix in errors[0]
    assert imported == []


#: (arguments, what the one ERROR line names): mistakes the server's status settles (it is queried
#: naming the client), each reported before LeRobot is imported, exit 3. The server serves r1 only,
#: at 30 fps, with the simulated robot's default cameras (front and wrist, 96x128).
STATUS_MISTAKES = [
    (["--client_uuid=stranger"], ["--client_uuid: server gpu0 does not serve client 'stranger'"]),
    (["--client_uuid=r1", "--fps=10"], ["--fps: server model runs at 30, client at 10"]),
    (["--client_uuid=r1", "--robot.cameras={front: [96, 128]}"],
     ["--robot.cameras: server expects ['front', 'wrist'], robot has ['front']"]),
    (["--client_uuid=r1", "--robot.cameras={front: [48, 64], wrist: [96, 128]}"],
     ["--robot.cameras: camera 'front': server expects 96x128, robot gives 48x64"]),
    # the server counts the task's tokens with its model's tokenizer (the synthetic policy: words)
    (["--client_uuid=r1", "--task=pick up the red cube; put it in the box = done"],
     ["--task: the task is 12 tokens, synthetic reads at most 4 (task_too_long)"]),
    (["--client_uuid=r1", "--dataset.repo_id=local/x", "--dataset.root={tmp}/ds",
      "--dataset.single_task=pick up the red cube and put it in the box"],
     ["--dataset.single_task: the task is 11 tokens, synthetic reads at most 4"]),
]


#: Where the client is told to connect: the server itself, or a router the server is linked to.
WHERE = {"endpoint": "--endpoint=127.0.0.1:{port}", "connect": "--zenoh.connect=[tcp/127.0.0.1:{port}]",
         "router": "--zenoh.connect=tcp/127.0.0.1:{router}"}


@pytest.mark.parametrize("where", WHERE)
def test_what_the_servers_status_settles_is_one_line_before_lerobot_is_imported(where, port, app_key, tmp_path):
    """Each STATUS_MISTAKES case through the real client, timed (docs/client.md quotes the times)."""
    import contextlib
    import time

    from lerobot_zenoh.transport.session import ZenohSession
    from lerobot_zenoh.transport.settings import ZenohSettings
    from lz_testing import free_port, make_server

    router = free_port()
    server = make_server(port, app_key, cameras={"front": (96, 128), "wrist": (96, 128)}, clients=["r1"],
                         max_task_tokens=4)
    routed = contextlib.nullcontext()
    if where == "router":  # the server links to the router; the client knows only the router
        routed = ZenohSession(ZenohSettings(mode="router", listen=[f"tcp/127.0.0.1:{router}"],
                                            multicast_scouting=False)).open()
        server.manifest = server.manifest.model_copy(
            update={"zenoh": server.manifest.zenoh.with_connect(f"tcp/127.0.0.1:{router}")})
    with routed, server:
        for args, needles in STATUS_MISTAKES:
            t0 = time.perf_counter()
            result, imported = probe(CLIENT, [SIM, WHERE[where].format(port=port, router=router),
                                              *(a.replace("{tmp}", str(tmp_path)) for a in args)])
            print(f"{where}: {' '.join(args)}: exit {result.returncode} in {time.perf_counter() - t0:.2f} s")
            errors = [line for line in result.stderr.splitlines() if " ERROR " in line]
            assert result.returncode == 3 and len(errors) == 1, (args, result.stderr[-2000:])
            for needle in needles:
                assert needle in errors[0], (needle, errors[0])
            assert imported == [], (args, imported)


HELP_SCRIPTS = ["client", "server", "build_checkpoint", "monitor", "router", "secure", "plan", "profile", "admit",
                "cache", "openpi", "ros2"]


@pytest.mark.parametrize("script", HELP_SCRIPTS)
def test_help_of_every_console_script_imports_neither_torch_nor_lerobot(script):
    result, imported = probe(f"lerobot_zenoh.cli.{script}", ["--help"])
    assert result.returncode == 0 and "--" in result.stdout, result.stderr[-2000:]
    assert imported == [], imported


def test_the_client_help_lists_its_options_and_the_robot_types_without_lerobot():
    result, _ = probe(CLIENT, ["--help"])
    out = result.stdout
    assert out.startswith("usage: lerobot-robot-client --robot.type=TYPE")
    assert "--fps int" in out and "--zenoh.mode" in out
    assert "so101_follower" in out and "zenoh_sim" in out and "--dataset" in out
    # Every flag that works, each choice group's description once, no developer text.
    assert "  --list " in out and "  --plugins " in out and "--pretrained_name_or_path" in out
    assert out.count("How overlapping actions of two chunks are blended") == 1 and "Which type of" not in out
    assert "--aggregate.type {weighted_average," in out and "Which one (default: weighted_average)" in out
    assert "(with --aggregate.type=weighted)" in out and "--aggregate.new_weight" in out


def test_every_console_script_is_listed_here():
    import tomllib

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert sorted(target.split(":")[0].rsplit(".", 1)[1] for target in scripts.values()) == sorted(HELP_SCRIPTS)


# -- a core install: every script works or names its extra ------------------------------------------

BLOCKER = """
import importlib.util, os, sys
_blocked = set(os.environ["LZ_BLOCK_MODULES"].split(","))
class _Absent:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in _blocked:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
_real = importlib.util.find_spec
def _find_spec(name, package=None):
    return None if name.split(".")[0] in _blocked else _real(name, package)
sys.meta_path.insert(0, _Absent())
importlib.util.find_spec = _find_spec
"""
#: What `pip install .` does not bring: the extras' packages.
NOT_IN_CORE = ("lerobot,torch,torchvision,torchcodec,transformers,diffusers,datasets,huggingface_hub,safetensors,"
               "accelerate,ortools,matplotlib,grpc,websockets,rosbags")


@pytest.fixture(scope="module")
def core_install(tmp_path_factory) -> dict:
    """The environment of a core install: a sitecustomize that makes the extras' modules absent."""
    folder = tmp_path_factory.mktemp("core")
    (folder / "sitecustomize.py").write_text(BLOCKER)
    return {"PYTHONPATH": f"{folder}{os.pathsep}{ROOT}", "LZ_BLOCK_MODULES": NOT_IN_CORE, "HF_HUB_OFFLINE": "1"}


CORE_CASES = [
    # (script, arguments, the extra it names, or None when it works)
    ("client", [SIM], "robot"),
    ("server", ["--policy.path=someone/x"], "server"),
    ("build_checkpoint", ["--output={tmp}/ck", "--state_dim=2"], "server"),
    ("build_checkpoint", ["--output={tmp}/vlm", "--policy_type=smolvlm"], "vla"),
    ("plan", ["--factory=factories/mix2.yaml", "--profiles=factories/rosa_profiles.yaml"], "planner"),
    ("cache", ["--folder={tmp}", "--repo_id=me/x"], "server"),
    ("openpi", ["--port=0"], "openpi"),
    ("ros2", ["--robots=[{{client_uuid: a, state: {{joints: [j]}}, action: {{topic: t, joints: [j]}}}}]"], "ros2"),
    ("secure", ["init", "--manifest", "manifests/demo.yaml", "--out", "{tmp}/pki"], None),
    ("monitor", ["--duration_s=0.5", "--zenoh.multicast_scouting=false"], None),
    ("client", ["--list", "--endpoint=127.0.0.1:{dead}", "--timeout_s=0.5"], None),
]


@pytest.mark.parametrize("script,args,extra", CORE_CASES, ids=[f"{c[0]} {c[2]}" for c in CORE_CASES])
def test_in_a_core_install_each_script_works_or_names_its_extra(core_install, tmp_path, script, args, extra):
    argv = [a.format(tmp=tmp_path, dead=dead_port()) for a in args]
    result = subprocess.run([sys.executable, "-m", f"lerobot_zenoh.cli.{script}", *argv], capture_output=True,
                            text=True, timeout=120, cwd=ROOT, env={**os.environ, **core_install})
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    if extra is None:  # it works (the --list case: nothing answers there, exit 3)
        assert result.returncode in (0, 3), result.stderr[-2000:]
    else:
        one_line(result, 2, f"needs the [{extra}] extra", f"pip install '.[{extra}]'")


def test_the_core_install_simulation_hides_the_extras(core_install):
    code = "import importlib.util; import ortools"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, **core_install})
    assert "No module named 'ortools'" in result.stderr


# -- hub ids offline, from a Hugging Face cache in a temporary HF_HOME -------------------------------

@pytest.fixture
def hf_cache(tmp_path, monkeypatch) -> Path:
    """huggingface_hub pointed at an empty cache under tmp_path, offline."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return tmp_path / "hf" / "hub"


def fake_checkpoint(folder: Path, weights: bytes = b"w") -> Path:
    (folder / "sub").mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"type": "act"}))
    (folder / "model.safetensors").write_bytes(weights)
    (folder / "sub" / "extra.json").write_text("{}")
    return folder


def test_a_placed_checkpoint_is_served_by_name_by_commit_and_by_commit_prefix_offline(hf_cache, tmp_path):
    from lerobot_zenoh.server.runners.hub import HubRef, checkpoint_folder, place_in_cache

    folder = fake_checkpoint(tmp_path / "mine")
    commit, snapshot = place_in_cache(folder, HubRef("me/act_pick"))
    assert snapshot == hf_cache / "models--me--act_pick" / "snapshots" / commit
    assert (hf_cache / "models--me--act_pick" / "refs" / "main").read_text() == commit
    assert (snapshot / "sub" / "extra.json").read_text() == "{}" and (snapshot / "config.json").is_symlink()
    assert place_in_cache(folder, HubRef("me/act_pick"))[0] == commit  # the same folder: the same snapshot
    where = tmp_path / "elsewhere"  # (a cwd without such a folder)
    for name in ("me/act_pick", f"me/act_pick@{commit}", f"me/act_pick@{commit[:7]}", "me/act_pick@main"):
        assert checkpoint_folder(name, where / name, "--policy.path") == snapshot, name
    other, _ = place_in_cache(fake_checkpoint(tmp_path / "v2", b"other"), HubRef("me/act_pick", "v2"))
    assert other != commit and checkpoint_folder("me/act_pick@v2", where / "x", "f").name == other
    assert checkpoint_folder("me/act_pick", where / "x", "f").name == commit  # main unchanged


def test_an_uncached_hub_id_says_how_to_fetch_or_place_it(hf_cache, tmp_path):
    from lerobot_zenoh.errors import PolicyError
    from lerobot_zenoh.server.runners.hub import checkpoint_folder

    with pytest.raises(PolicyError) as err:
        checkpoint_folder("me/none@fedcba9", tmp_path / "me" / "none", "--policy.path")
    text = str(err.value)
    assert "HF_HUB_OFFLINE is set" in text and "`hf download me/none --revision fedcba9`" in text
    assert "lerobot-zenoh-cache --folder=FOLDER --repo_id=me/none" in text


def test_a_missing_local_folder_is_reported_as_one_not_as_a_hub_id(hf_cache, tmp_path):
    from lerobot_zenoh.errors import PolicyError
    from lerobot_zenoh.server.runners.hub import checkpoint_folder

    fake_checkpoint(tmp_path / "checkpoints" / "demo_act")
    with pytest.raises(PolicyError) as err:
        checkpoint_folder("checkpoints/demo_actt", tmp_path / "checkpoints" / "demo_actt", "--policy.path")
    text = str(err.value)
    assert f"no folder {tmp_path / 'checkpoints' / 'demo_actt'}" in text
    assert f"did you mean {tmp_path / 'checkpoints' / 'demo_act'}?" in text and "hf download" not in text


def test_a_training_output_folder_is_answered_with_its_checkpoint(hf_cache, tmp_path):
    from lerobot_zenoh.errors import PolicyError
    from lerobot_zenoh.server.runners.hub import checkpoint_folder, place_in_cache, HubRef

    run = tmp_path / "outputs" / "train" / "act_pick"
    fake_checkpoint(run / "checkpoints" / "last" / "pretrained_model")
    for given in (run, run / "checkpoints" / "last"):
        with pytest.raises(PolicyError) as err:
            checkpoint_folder(str(given), given, "--policy.path")
        assert f"give the checkpoint inside it, {run / 'checkpoints' / 'last' / 'pretrained_model'}" in str(err.value)
        with pytest.raises(PolicyError, match="training output folder"):
            place_in_cache(given, HubRef("me/x"))


def test_the_server_reports_a_bad_policy_path_before_importing_torch(tmp_path):
    fake_checkpoint(tmp_path / "checkpoints" / "demo_act")
    run = tmp_path / "run"
    fake_checkpoint(run / "checkpoints" / "last" / "pretrained_model")
    env = {"HF_HOME": str(tmp_path / "hf")}
    typo, imported = probe("lerobot_zenoh.cli.server", ["--policy.path=checkpoints/demo_actt"], env, cwd=tmp_path)
    one_line(typo, 2, "--policy.path: no folder checkpoints/demo_actt (did you mean checkpoints/demo_act?)")
    assert imported == []
    training, _ = probe("lerobot_zenoh.cli.server", [f"--policy.path={run}"], env, cwd=tmp_path)
    one_line(training, 2, f"{run / 'checkpoints' / 'last' / 'pretrained_model'}")
    uncached, _ = probe("lerobot_zenoh.cli.server", ["--policy.path=me/none"], env, cwd=tmp_path)
    one_line(uncached, 2, "`hf download me/none`")


def test_lerobot_zenoh_cache_places_a_folder_in_one_command(tmp_path):
    folder = fake_checkpoint(tmp_path / "mine")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    cache = [sys.executable, "-m", "lerobot_zenoh.cli.cache"]
    placed = subprocess.run([*cache, f"--folder={folder}", "--repo_id=me/act_pick"], capture_output=True, text=True,
                            env=env, timeout=60)
    assert placed.returncode == 0, placed.stderr
    name, _, where = placed.stdout.strip().partition(" (me/act_pick) -> ")
    assert name.startswith("me/act_pick@") and Path(where, "config.json").is_file()
    assert "--policy.path=me/act_pick" in placed.stderr
    script = ("from pathlib import Path; from lerobot_zenoh.server.runners.hub import checkpoint_folder; "
              f"print(checkpoint_folder('{name}', Path('none'), 'f'))")
    found = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60)
    assert found.stdout.strip() == where, found.stderr
    for args, needle in (([f"--folder={tmp_path / 'mine2'}", "--repo_id=me/x"], "--folder: no folder"),
                         ([f"--folder={tmp_path}", "--repo_id=me/x"], "holds no config.json"),
                         ([f"--folder={folder}", "--repo_id=me"], "--repo_id: 'me' is not USER/NAME")):
        result = subprocess.run([*cache, *args], capture_output=True, text=True, env=env, timeout=60)
        one_line(result, 2, needle)


# -- make demo: stages, finished robots, the columns explained, the README's sample -----------------

def test_the_demo_shows_each_robots_stage_and_when_it_finished(tmp_path):
    from lerobot_zenoh.demo import live_line
    from lerobot_zenoh.telemetry.fleet import FleetView

    (tmp_path / "robot_1.log").write_text("x INFO [robot_1] lerobot-robot-client: starting: importing LeRobot\n")
    (tmp_path / "robot_2.log").write_text("x INFO [robot_2] lerobot-robot-client: starting: asking 127.0.0.1:1 what "
                                          "it serves\n")
    line = live_line(FleetView(), ["robot_1", "robot_2", "robot_3", "robot_4"], 3.0, tmp_path,
                     {"robot_1": None, "robot_2": None, "robot_3": None, "robot_4": 0})
    assert line == ("[   3 s] robot_1: importing LeRobot | robot_2: connecting | robot_3: reading its flags | "
                    "robot_4: finished")


def test_the_readme_sample_is_the_demos_table_with_its_legend(tmp_path, capsys):
    from lerobot_zenoh.demo import COLUMNS, print_table

    print_table(tmp_path, ["robot_1"], [0])
    header = capsys.readouterr().out.strip().splitlines()[0]
    readme = (ROOT / "README.md").read_text()
    assert header in readme and "rtc delay" in header
    assert COLUMNS.strip() in readme


def test_a_busy_port_is_one_line_naming_what_the_user_typed(tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        runs = {}
        for label, extra in (("python", {}), ("make", {"DEMO_PORT_VARIABLE": "PORT"})):
            runs[label], imported = probe("lerobot_zenoh.demo", [f"--port={port}", f"--out={tmp_path}"], extra)
            assert imported == []
    one_line(runs["python"], 2, f"port {port} on 127.0.0.1 is in use", "choose another with --port=")
    one_line(runs["make"], 2, "choose another with make demo PORT=")
    assert "--endpoint" not in runs["make"].stderr


def test_the_cameras_the_flags_say_are_read_without_lerobot():
    from lerobot_zenoh.cli.client import cameras_from_flags

    assert cameras_from_flags({"--robot.type": "so101_follower"}) is None  # its cameras: known once it is open
    assert cameras_from_flags({"--robot.type": "zenoh_sim"}) == {"front": (96, 128), "wrist": (96, 128)}
    lerobot_style = ("{front: {type: opencv, index_or_path: 0, width: 640, height: 480, fps: 30}, "
                     "wrist: {type: opencv, width: 640, height: 480, rotation: 90}, top: {type: realsense}}")
    assert cameras_from_flags({"--robot.cameras": lerobot_style}) == {"front": (480, 640), "wrist": None, "top": None}
    assert cameras_from_flags({"--robot.cameras": "{front: [48, 64]}"}) == {"front": (48, 64)}
    for unreadable in ("[1, 2]", "{front: 3}", "{front: [1, 2"):
        assert cameras_from_flags({"--robot.cameras": unreadable}) is None
