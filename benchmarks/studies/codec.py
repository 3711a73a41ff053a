"""JPEG codecs side by side in one run: encode and decode time, size and quality (PSNR against the raw frame).

    python -m benchmarks.studies.codec [--n 40] [--quality 90]

Candidates: OpenCV (today's codec before this benchmark chose), simplejpeg (libjpeg-turbo bundled in its
wheel) with and without the fast (integer, less exact) DCT and fast chroma upsampling, and PyTurboJPEG
when importable (it needs the system's libturbojpeg). Every candidate encodes RGB at the same quality
with 4:2:0 chroma subsampling (OpenCV's default); quality is the PSNR of encode-then-decode against
the raw frame, over the same frames. Times are medians per frame on one thread.
"""

from __future__ import annotations

import argparse
import json
import time


import cv2
import numpy as np

from benchmarks.harness.workloads import JPEG_QUALITY, SceneCamera


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float32) - b.astype(np.float32)) ** 2))
    return float("inf") if mse == 0 else 10.0 * np.log10(255.0**2 / mse)


def candidates(quality: int) -> dict:
    """name -> (encode(rgb) -> bytes, decode(bytes) -> rgb)."""
    out = {
        "opencv": (
            lambda rgb: cv2.imencode(".jpg", cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR), [cv2.IMWRITE_JPEG_QUALITY, quality])[1].tobytes(),
            lambda data: cv2.cvtColor(cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR), cv2.COLOR_BGR2RGB),
        ),
    }
    try:
        import simplejpeg
    except ImportError:
        simplejpeg = None
    if simplejpeg is not None:
        for enc_fast in (False, True):
            for dec_fast in (False, True):
                name = f"simplejpeg enc{'-fastdct' if enc_fast else ''} dec{'-fast' if dec_fast else ''}"
                out[name] = (
                    lambda rgb, f=enc_fast: simplejpeg.encode_jpeg(rgb, quality, "RGB", "420", f),
                    lambda data, f=dec_fast: simplejpeg.decode_jpeg(data, "RGB", fastdct=f, fastupsample=f),
                )
    try:
        import turbojpeg

        tj = turbojpeg.TurboJPEG()
    except (ImportError, OSError, RuntimeError):
        tj = None
    if tj is not None:
        for fast in (False, True):
            flags = (turbojpeg.TJFLAG_FASTDCT | turbojpeg.TJFLAG_FASTUPSAMPLE) if fast else 0
            out[f"pyturbojpeg{' fastdct+fastup' if fast else ''}"] = (
                lambda rgb, fl=flags: tj.encode(rgb, quality, turbojpeg.TJPF_RGB, turbojpeg.TJSAMP_420, flags=fl),
                lambda data, fl=flags: tj.decode(data, turbojpeg.TJPF_RGB, flags=fl),
            )
    return out


def run(n: int, quality: int) -> dict:
    results = {}
    for label, (h, w) in (("480x640", (480, 640)), ("720x1280", (720, 1280))):
        frames = [SceneCamera(h, w, s).frame(k) for s in range(2) for k in range(n // 2)]
        rows = {}
        for name, (enc, dec) in candidates(quality).items():
            enc_s, dec_s, sizes, q = [], [], [], []
            for rgb in frames:
                t0 = time.perf_counter()
                data = enc(rgb)
                t1 = time.perf_counter()
                back = dec(data)
                t2 = time.perf_counter()
                enc_s.append(t1 - t0)
                dec_s.append(t2 - t1)
                sizes.append(len(data))
                q.append(psnr(rgb, back))
            rows[name] = {
                "encode_ms": 1e3 * float(np.median(enc_s)),
                "decode_ms": 1e3 * float(np.median(dec_s)),
                "kb": float(np.mean(sizes)) / 1e3,
                "psnr_db": float(np.mean(q)),
            }
        results[label] = rows
    return results


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=40, help="frames per size (two scenes)")
    ap.add_argument("--quality", type=int, default=JPEG_QUALITY)
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args(argv)
    results = run(args.n, args.quality)
    for size, rows in results.items():
        base = rows["opencv"]
        print(f"\n{size}, quality {args.quality}, {args.n} frames (median per frame)")
        print(f"{'codec':34s} {'encode ms':>9s} {'decode ms':>9s} {'enc+dec':>8s} {'vs cv2':>7s} {'KB':>6s} {'PSNR dB':>8s}")
        for name, r in rows.items():
            total = r["encode_ms"] + r["decode_ms"]
            ratio = total / (base["encode_ms"] + base["decode_ms"])
            print(f"{name:34s} {r['encode_ms']:9.2f} {r['decode_ms']:9.2f} {total:8.2f} {ratio:7.2f} {r['kb']:6.1f} {r['psnr_db']:8.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
