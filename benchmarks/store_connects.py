"""How long ranks take to connect to one torch TCPStore at once (torch alone, no Dask).

    python benchmarks/store_connects.py [--clients 8 16 32 64 128]

Every rank of a mesh connects to its rank 0's store at the first collective
(``BackendNetworkInit``), all at once. Torch looks up the host name of both
ends of each store connection (c10d's ``formatSockAddr``, ``getnameinfo``),
so the burst of connects is a burst of lookups: a resolver that drops some
adds its timeout (5 s by default) to those connects. Run it where the ranks
run to see whether the resolver keeps up (benchmarks/RESULTS.md, "Issue 38,
fourth round"; docs/deployment.md, "At hundreds of ranks").
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import threading
import time

import torch.distributed as dist


def connects(clients: int, host: str) -> list[float]:
    server = dist.TCPStore(
        host, 0, None, True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False
    )
    took: list[float] = []

    def connect() -> None:
        start = time.perf_counter()
        dist.TCPStore(host, server.port, None, False, timeout=datetime.timedelta(seconds=60))
        took.append(time.perf_counter() - start)

    threads = [threading.Thread(target=connect) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[8, 16, 32, 64, 128])
    parser.add_argument("--host", default="127.0.0.1")
    args = parser.parse_args()
    for n in args.clients:
        took = connects(n, args.host)
        print(
            f"{n:4d} clients at once: median {statistics.median(took) * 1e3:7.1f} ms, "
            f"slowest {max(took) * 1e3:7.1f} ms",
            flush=True,
        )


if __name__ == "__main__":
    main()
