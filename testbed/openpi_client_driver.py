"""Drives the OpenPI front door with the official openpi-client (run by .venv-openpi's Python, not ours).

    python openpi_client_driver.py '<json: {"port", "mode", ...}>'   -> one JSON line on stdout

Modes: `broker` (ActionChunkBroker over WebsocketClientPolicy for `steps` steps), `chunks` (plain
`infer` calls on one observation: `repeat` of them, and more until `seconds` have passed), `bad` (each listed bad request, then a good one), `raw`
(bytes written on the client's own connection, for what its packer refuses to send).
Observations are made from `seed` exactly as `observation()` in tests/test_openpi.py makes them, or
read from `obs_file` (benchmarks/studies/openpi_front_door.py).
"""

import json
import sys
import time

import msgpack
import numpy as np
from openpi_client import msgpack_numpy
from openpi_client.action_chunk_broker import ActionChunkBroker
from openpi_client.websocket_client_policy import WebsocketClientPolicy


def observation(seed, shapes, state_dim):
    rng = np.random.default_rng(seed)
    obs = {key: rng.integers(0, 256, size=shape, dtype=np.uint8) for key, shape in shapes.items()}
    obs["observation/state"] = rng.normal(size=state_dim).astype(np.float64)
    obs["prompt"] = "pick up the cube"
    return obs


def listed(x):
    return np.asarray(x).tolist()


def main():
    args = json.loads(sys.argv[1])
    shapes = {k: tuple(v) for k, v in args.get("shapes", {}).items()}
    state_dim = args.get("state_dim", 6)
    out = {}
    if args.get("source"):  # connect from this loopback address (a peer of its own for the door's cool-down)
        import socket

        create_connection = socket.create_connection
        socket.create_connection = lambda address, *a, **kw: create_connection(
            address, *a, **{**kw, "source_address": (args["source"], 0)})
    try:
        if args.get("tls"):  # wss://, trusting the CA named by SSL_CERT_FILE
            policy = WebsocketClientPolicy(f"wss://127.0.0.1:{args['port']}", api_key=args.get("api_key"))
        else:
            policy = WebsocketClientPolicy("127.0.0.1", args["port"], api_key=args.get("api_key"))
    except Exception as exc:
        print(json.dumps({"connect_error": f"{type(exc).__name__}: {exc}"}))
        return
    out["metadata"] = policy.get_server_metadata()
    mode = args["mode"]
    obs = observation(args.get("seed", 0), shapes, state_dim)
    if args.get("obs_file"):  # a benchmark's observation (npz of arrays, never pickled)
        with np.load(args["obs_file"], allow_pickle=False) as saved:
            obs = {key: saved[key] for key in saved.files}
        obs["prompt"] = "pick up the cube"
    if mode == "broker":
        broker = ActionChunkBroker(policy, action_horizon=args["horizon"])
        steps = []
        for _ in range(args["steps"]):
            step = broker.infer(obs)
            steps.append({"actions": listed(step["actions"]), "server_timing": step["server_timing"]})
        out["steps"] = steps
    elif mode == "chunks":
        out["chunks"], out["timing"] = [], []
        end = time.monotonic() + args.get("seconds", 0)
        for i in range(10**9):
            if i >= args.get("repeat", 0) and time.monotonic() >= end:
                break
            t0 = time.perf_counter()
            result = policy.infer(obs)
            out["timing"].append({"client_ms": (time.perf_counter() - t0) * 1000, **result["server_timing"]})
            out["chunks"].append(listed(result["actions"]))
    elif mode in ("bad", "raw"):
        out["errors"] = []
        for change in args["requests"]:
            try:
                if mode == "bad":
                    request = dict(obs)
                    for key, value in change.items():
                        if value is None:
                            request.pop(key)
                        else:
                            request[key] = np.zeros(value["shape"], dtype=value["dtype"])
                    policy.infer(request)
                else:
                    policy._ws.send(bytes.fromhex(change))
                    reply = policy._ws.recv()
                    if isinstance(reply, str):
                        raise RuntimeError(f"Error in inference server:\n{reply}")
                out["errors"].append(None)
            except RuntimeError as exc:
                out["errors"].append(str(exc))
            except Exception as exc:
                out["errors"].append(f"{type(exc).__name__}: {exc}")
                print(json.dumps(out))
                return
        if args.get("after", True):
            out["after"] = listed(policy.infer(obs)["actions"])
    print(json.dumps(out, default=listed))


if __name__ == "__main__":
    del msgpack, msgpack_numpy  # imported to fail early here when the environment lacks them
    main()
