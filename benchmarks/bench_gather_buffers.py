"""What a gather's buffer costs on the CPU: widening a group's bf16 values into its fp32 full buffer, the buffer freshly
allocated each time (as torch allocates it: a mapping of its own, its pages faulted in and zeroed at first touch)
against the same storage resized through zinf's gather buffer cache ([Note: gather buffer cache] in
zinf/native/buffer_cache.py), with the minor page faults each takes. One thread.

    python benchmarks/bench_gather_buffers.py [--numel 100000000 --repeats 5]

Rows: the widening into a fresh buffer (``torch.empty`` then ``copy_``, freed after), into a storage resized to 0
and back through the cache (the reshard and the next gather, as zinf does), and into a buffer that is simply kept
(the floor: the copy alone). Medians of ``--repeats`` after one warm-up.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import torch

from zinf.native.buffer_cache import buffer_cache, unavailable_reason


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _measure(gather, repeats: int) -> tuple[float, float]:
    gather()  # warm-up
    times, faults = [], []
    for _ in range(repeats):
        f0, t0 = _faults(), time.perf_counter()
        gather()
        times.append(time.perf_counter() - t0)
        faults.append(_faults() - f0)
    return statistics.median(times), statistics.median(faults)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", type=int, default=100_000_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    shard = torch.randn(args.numel).to(torch.bfloat16)

    def fresh() -> None:
        full = torch.empty(args.numel)
        full.copy_(shard)
        del full

    rows = [("fresh buffer (torch.empty)", *_measure(fresh, args.repeats))]
    cache = buffer_cache()
    if cache is not None:
        full = torch.empty(0)
        storage = full.untyped_storage()
        nbytes = args.numel * 4

        def cached() -> None:
            cache.resize(storage, nbytes)
            full.set_(storage, 0, (args.numel,))
            full.copy_(shard)
            storage.resize_(0)

        rows.append(("same storage, through the cache", *_measure(cached, args.repeats)))

        def missed() -> None:
            cached()
            cache.clear()  # the block goes back to the system: the next gather misses

        rows.append(("through the cache, a miss each time (huge pages)", *_measure(missed, args.repeats)))
    else:
        print(f"gather buffer cache unavailable: {unavailable_reason()}")
    kept = torch.empty(args.numel)
    rows.append(("buffer kept (the copy alone)", *_measure(lambda: kept.copy_(shard), args.repeats)))

    base = rows[-1][1]
    print(f"bf16 -> fp32 widening of {args.numel:,} values ({args.numel * 4 / 1e6:,.0f} MB written), one thread, "
          f"torch {torch.__version__}")
    print("| buffer | seconds | GB/s written | minor faults | x the copy alone |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, seconds, faults in rows:
        print(f"| {name} | {seconds:.4f} | {args.numel * 4 / seconds / 1e9:.1f} | {faults:,.0f} | {seconds / base:.1f}x |")


if __name__ == "__main__":
    main()
