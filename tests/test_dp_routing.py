"""Data parallelism's cache-aware routing: the API process hashes prompts exactly as the
engine does; two engine core processes behind ``DPClient`` keep each shared prefix on one
replica, so the prefix cache serves as many tokens as one replica would, where round
robin (a mutant router) serves fewer; load beats locality past ``max_imbalance``; a dead
replica fails only its own requests; and ``serve --data-parallel-size 2`` answers as
offline ``generate`` does."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import openai
import pytest

from paged_engine import LLM, SamplingParams
from paged_engine.engine.block_manager import BlockManager
from paged_engine.engine.sequence import Sequence as EngineSequence
from paged_engine.entrypoints.core_client import CoreClient
from paged_engine.entrypoints.core_process import CoreSpec
from paged_engine.entrypoints.dp_client import DPClient, PrefixIndex, prompt_block_hashes
from paged_engine.entrypoints.metrics import ServerMetrics
from paged_engine.sampling_params import RequestOutputKind
from tests.test_server_support import MODEL, PROMPTS, parse_metrics, serve_process

pytestmark = pytest.mark.timeout(240)
BLOCK = 8
PARAMS = SamplingParams(
    temperature=0, max_tokens=4, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY
)


@pytest.mark.parametrize("algorithm", ["xxh64", "sha256"])
@pytest.mark.parametrize("salt", [None, "tenant-a"])
def test_the_router_hashes_prompts_as_the_engine_does(algorithm: str, salt: str | None) -> None:
    tokens = list(range(100, 141))  # 5 full blocks and one token
    manager = BlockManager(num_blocks=16, block_size=BLOCK, hash_algorithm=algorithm)
    seq = EngineSequence(tokens, SamplingParams(), block_size=BLOCK, cache_salt=salt)
    assert prompt_block_hashes(tokens, BLOCK, algorithm, salt) == manager.hash_chain(seq, 5)


def test_the_prefix_index_forgets_the_least_recently_used() -> None:
    index = PrefixIndex(capacity=3)
    index.add([1, 2, 3])
    index.add([1])  # 1 is now the most recent
    index.add([4])
    assert index.match([1]) == 1 and index.match([2]) == 0
    assert index.match([3, 4]) == 2 and index.match([1, 9]) == 1


class _Replica:
    """What ``DPClient`` reads of a replica, without a process."""

    def __init__(self, alive: bool = True) -> None:
        self.alive, self.observer, self.snapshot, self.fatal = alive, None, None, None
        self.info = type("Info", (), {"block_size": BLOCK, "prefix_cache_hash": "xxh64"})()


def test_the_longest_prefix_wins_until_load_outweighs_it() -> None:
    dp = DPClient([_Replica(), _Replica(), _Replica(alive=False)], max_imbalance=2)  # type: ignore[list-item]
    dp.indexes[1].add([7, 8])
    assert dp.choose([7, 8, 9]) == 1
    assert dp.choose([5]) == 0  # no match anywhere: the least used
    dp.in_flight[1] = 3
    assert dp.choose([7, 8, 9]) == 0  # 3 beyond replica 0's 0: past max_imbalance
    dp.indexes[2].add([7, 8, 9])
    assert dp.choose([7, 8, 9]) == 0  # replica 2 is dead


def test_metrics_show_each_replicas_state() -> None:
    """What ``/metrics`` reads of the router at scrape time; a single core has no such
    series."""
    dp = DPClient([_Replica(), _Replica(), _Replica()])  # type: ignore[list-item]
    dp.in_flight[0] = 3
    dp.replicas[2].alive = False
    metrics = ServerMetrics()
    metrics.bind(dp)
    m = parse_metrics(metrics.render().decode())
    alive = [m[f'dp_replica_alive{{replica="{i}"}}'] for i in range(3)]
    load = [m[f'dp_replica_in_flight{{replica="{i}"}}'] for i in range(3)]
    assert alive == [1.0, 1.0, 0.0] and load == [3.0, 0.0, 0.0]
    single = ServerMetrics()
    single.bind(_Replica())  # type: ignore[arg-type]
    assert "dp_replica" not in single.render().decode()


# ---- two real replicas -----------------------------------------------------------------


class RoundRobin(DPClient):
    """The mutant: ignores the prefixes."""

    turn = 0

    def choose(self, hashes: Sequence[int]) -> int:
        self.turn += 1
        return self.turn % len(self.replicas)


@pytest.fixture(scope="module")
def cores(tiny_model_dir: Path) -> Iterator[list[CoreClient]]:
    spec = CoreSpec(str(tiny_model_dir), {"kvcache_block_size": BLOCK, "num_threads": 1})
    cores = [CoreClient(spec) for _ in range(2)]
    for c in cores:
        c.launch()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    for c in cores:
        c.start(loop)
    cores[0].test_loop = loop  # type: ignore[attr-defined]
    yield cores
    for c in cores:
        c.stop(5)
    loop.call_soon_threadsafe(loop.stop)


def run(dp: DPClient, loop: Any, prompts: list[list[int]], tag: str) -> list[Any]:
    """Each prompt in turn (the next sent once the last has finished); their outputs."""

    async def one(i: int, prompt: list[int]) -> Any:
        prompt_dict = {"prompt_token_ids": prompt, "cache_salt": tag}  # tests do not share
        sink = await dp.submit([(f"{tag}-{i}", prompt_dict, PARAMS)], 0.0)
        return await sink.get()

    return [
        asyncio.run_coroutine_threadsafe(one(i, p), loop).result(60) for i, p in enumerate(prompts)
    ]


def shared_prefix_prompts(seed: int) -> list[list[int]]:
    """Order A A B B A B A B over two 40-token prefixes (5 blocks), 5 tokens after each."""
    a = [seed + i for i in range(40)]
    b = [seed + 300 + i for i in range(40)]
    return [
        p + [seed + 600 + i * 5 + j for j in range(5)]
        for i, p in enumerate([a, a, b, b, a, b, a, b])
    ]


@pytest.mark.parametrize(("router", "cached"), [(DPClient, 240), (RoundRobin, 160)])
def test_shared_prefixes_stay_on_one_replica(
    cores: list[CoreClient], router: type[DPClient], cached: int
) -> None:
    """Cache-aware: each prefix computed once, its 6 later requests hit all 5 blocks (as
    one replica would); round robin computes each twice (checked: the mutant's count)."""
    dp = router(cores)
    outs = run(
        dp,
        cores[0].test_loop,
        shared_prefix_prompts(10),
        router.__name__,
    )  # type: ignore[attr-defined]
    assert all(o.finished for o in outs)
    assert sum(o.num_cached_tokens for o in outs) == cached
    if router is DPClient:
        assert sorted(dp.routed) == [4, 4]  # the two prefixes on different replicas
        assert dp.in_flight == [0, 0]


def core_pids(server_pid: int) -> list[int]:
    found = []
    for children in Path(f"/proc/{server_pid}/task").glob("*/children"):
        for pid in children.read_text().split():
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            if b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
                found.append(int(pid))
    return found


def test_dp2_server_answers_as_offline(tiny_model_dir: Path) -> None:
    llm = LLM(tiny_model_dir, block_size=8, num_threads=1)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    offline = [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    with serve_process(tiny_model_dir, "--data-parallel-size", "2") as (url, proc):
        api = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        got = [
            api.completions.create(
                model=MODEL, prompt=p, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
            )
            .choices[0]
            .text
            for p in PROMPTS
        ]
        assert got == offline
        cores = core_pids(proc.pid)
        assert len(cores) == 2
        os.kill(cores[0], signal.SIGKILL)  # one replica dies: the other serves on
        deadline = time.monotonic() + 10
        while len(core_pids(proc.pid)) > 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.5)  # the reader thread notices the closed pipe
        again = api.completions.create(
            model=MODEL,
            prompt=PROMPTS[0],
            max_tokens=8,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert again.choices[0].text == offline[0]
        assert proc.poll() is None


def test_replicas_and_tensor_parallelism_compose(tiny_model_dir: Path) -> None:
    """DP=2 x TP=2: two cores, each the rank 0 of its own two-rank group (five processes
    besides the test's), still the offline text."""
    llm = LLM(tiny_model_dir, block_size=8, num_threads=1)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    offline = [o.outputs[0].text for o in llm.generate(PROMPTS[:4], params, use_tqdm=False)]
    flags = ("--data-parallel-size", "2", "--tensor-parallel-size", "2")
    with serve_process(tiny_model_dir, *flags) as (url, proc):
        api = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        got = [
            api.completions.create(
                model=MODEL, prompt=p, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
            )
            .choices[0]
            .text
            for p in PROMPTS[:4]
        ]
        assert got == offline
        assert len(core_pids(proc.pid)) == 2
