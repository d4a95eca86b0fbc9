"""scripts/mutation.py's own logic: verdict counting, the score cells, which mutants a run
passes to mutmut, the random sample and its Wilson interval, the no-shrink plugin. No
mutmut run: every test builds a fake mutants/ directory under tmp_path.

Expected intervals are textbook values (Wilson 1927; e.g. Newcombe 1998, table I), not
recomputed with the code under test.
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

import pytest
from hypothesis import Phase, settings

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

import mutation
import mutation_plugin
import mutation_sample

BM = "paged_engine.engine.block_manager.x_f__mutmut_"
SP = "spec.hashing.x_g__mutmut_"


def _meta(mutants: Path, path: str, codes: dict[str, int | None]) -> None:
    meta = mutants / f"{path}.meta"
    meta.parent.mkdir(parents=True, exist_ok=True)
    meta.write_text(json.dumps({"exit_code_by_key": codes}))


@pytest.fixture
def mutants(tmp_path: Path) -> Path:
    """block_manager: 1, 2 killed, 3 survived, 4 timeout, 5 no tests, 6 and 7 not run;
    spec/hashing.py: 1..10 not run. Mutant 3 is killed later by a recheck."""
    root = tmp_path / "mutants"
    codes = {1: 1, 2: 3, 3: 0, 4: 36, 5: 33, 6: None, 7: None}
    _meta(root, "paged_engine/engine/block_manager.py", {f"{BM}{k}": v for k, v in codes.items()})
    _meta(root, "spec/hashing.py", {f"{SP}{k}": None for k in range(1, 11)})
    return root


def test_verdicts_count_the_recheck_kills_as_killed_later(mutants: Path) -> None:
    (mutants / "recheck.json").write_text(json.dumps({f"{BM}3": {"killed": True}}))
    scores, survivors = mutation.read_results(mutants)
    bm = {s.path: s for s in scores}["paged_engine/engine/block_manager.py"]
    assert bm.counts == {
        "killed": 2,
        "killed later": 1,
        "timeout": 1,
        "survived": 0,
        "no tests": 1,
        "not run": 2,
        "other": 0,
    }
    assert survivors == []
    assert bm.decided == 5
    assert bm.score == pytest.approx(4 / 5)
    assert bm.score_cell() == "80% of 5 decided (partial)"


def test_the_score_is_exact_only_when_every_mutant_is_decided() -> None:
    counts = dict.fromkeys(mutation.COLUMNS, 0)
    done = mutation.FileScore("f.py", {**counts, "killed": 9, "survived": 1})
    assert done.score_cell() == "90%"
    assert mutation.FileScore("f.py", {**counts, "not run": 3}).score_cell() == "-"
    half = mutation.FileScore("f.py", {**counts, "killed": 1, "survived": 1, "not run": 2})
    assert half.score_cell() == "50% of 2 decided (partial)"
    sampled = mutation.FileScore(
        half.path, half.counts, mutation_sample.Estimate(0.9, 0.8, 0.95, 2, 2, 4)
    )
    assert sampled.score_cell() == "~90% (95% CI 80-95%; sample of 2 from 4 not run before)"
    late = mutation_sample.Estimate(0.9, 0.8, 0.95, 2, 3, 4)
    assert mutation.FileScore(half.path, half.counts, late).score_cell() == (
        "~90% (95% CI 80-95%; sample of 2 from 4 not run before, 1 drawn not run yet)"
    )


def test_a_glob_runs_only_the_matching_mutants_not_run_yet(mutants: Path) -> None:
    verdicts = mutation.read_verdicts(mutants)
    assert mutation.not_run(verdicts, ["paged_engine.*"]) == {
        "paged_engine/engine/block_manager.py": [f"{BM}6", f"{BM}7"]
    }
    assert mutation.not_run(verdicts, ["nothing*"]) == {}
    names = mutation.to_run(["paged_engine.*", "spec.*"], None, 0, mutants)
    assert sorted(names) == sorted([f"{BM}6", f"{BM}7"] + [f"{SP}{k}" for k in range(1, 11)])
    assert not (mutants / "sample.json").exists()


@pytest.mark.parametrize(
    ("caught", "n", "low", "high"),
    [(8, 10, 0.4902, 0.9433), (0, 10, 0.0, 0.2775), (10, 10, 0.7225, 1.0), (5, 10, 0.2366, 0.7634)],
)
def test_wilson_matches_the_textbook_intervals(
    caught: int, n: int, low: float, high: float
) -> None:
    assert mutation_sample.wilson(caught, n) == pytest.approx((low, high), abs=5e-5)


@pytest.mark.parametrize(("caught", "n"), [(3, 2), (-1, 4), (0, 0)])
def test_wilson_refuses_impossible_counts(caught: int, n: int) -> None:
    with pytest.raises(ValueError, match="0 <= caught <= n"):
        mutation_sample.wilson(caught, n)


def test_a_sample_draws_n_per_file_from_the_not_run_and_records_them(mutants: Path) -> None:
    first = mutation.to_run(["*"], 3, 7, mutants)
    samples = mutation_sample.read_samples(mutants / "sample.json")
    bm, sp = samples["paged_engine/engine/block_manager.py"], samples["spec/hashing.py"]
    assert bm.population == [f"{BM}6", f"{BM}7"]  # decided mutants are never drawn
    assert sorted(bm.drawn) == [f"{BM}6", f"{BM}7"]  # fewer left than asked for: all
    assert sp.population == sorted(f"{SP}{k}" for k in range(1, 11))
    assert len(sp.drawn) == 3 and set(sp.drawn) <= set(sp.population)
    assert sorted(first) == sorted(bm.drawn + sp.drawn)
    # The same seed again draws other names: without replacement, up to the population.
    second = mutation.to_run(["spec.*"], 3, 7, mutants)
    assert len(second) == 3 and not set(second) & set(sp.drawn)
    again = mutation_sample.read_samples(mutants / "sample.json")["spec/hashing.py"]
    assert again.drawn == sp.drawn + second and again.population == sp.population


def test_the_same_seed_draws_the_same_sample(tmp_path: Path) -> None:
    waiting = {"a.py": [f"m{k}" for k in range(50)]}
    one: dict[str, mutation_sample.FileSample] = {}
    two: dict[str, mutation_sample.FileSample] = {}
    assert mutation_sample.draw(one, waiting, 5, 1) == mutation_sample.draw(two, waiting, 5, 1)
    other: dict[str, mutation_sample.FileSample] = {}
    assert mutation_sample.draw(other, waiting, 5, 2) != one["a.py"].drawn


def test_a_bad_sample_size_is_refused_and_nothing_is_recorded(mutants: Path) -> None:
    samples: dict[str, mutation_sample.FileSample] = {}
    with pytest.raises(ValueError, match="sample size must be at least 1, got 0"):
        mutation_sample.draw(samples, {"a.py": ["m1"]}, 0, 1)
    assert samples == {}
    with pytest.raises(SystemExit):
        mutation.main(["--sample", "0", "spec.*"])
    assert not (mutants / "sample.json").exists()


def test_the_estimate_counts_the_decided_exactly_and_scales_the_sample() -> None:
    # 10 decided before the draw (all killed); a population of 90, of which 10 drawn:
    # 5 killed, 5 survived. Estimate (10 + 90 * 0.5) / 100; the interval scales
    # Wilson(5, 10) = (0.2366, 0.7634) the same way.
    verdicts = {f"old{k}": "killed" for k in range(10)}
    population = [f"new{k}" for k in range(90)]
    verdicts |= {m: "not run" for m in population}
    drawn = population[:10]
    verdicts |= {m: ("killed later" if k % 2 else "survived") for k, m in enumerate(drawn)}
    verdicts[population[50]] = "killed"  # decided since, not drawn: not in the estimate
    e = mutation_sample.estimate(verdicts, mutation_sample.FileSample(population, drawn))
    assert e is not None
    assert (e.drawn_decided, e.drawn, e.population) == (10, 10, 90)
    assert e.score == pytest.approx(0.55)
    assert e.low == pytest.approx((10 + 90 * 0.2366) / 100, abs=1e-4)
    assert e.high == pytest.approx((10 + 90 * 0.7634) / 100, abs=1e-4)
    none_decided = {**verdicts, **dict.fromkeys(drawn, "not run")}
    assert (
        mutation_sample.estimate(none_decided, mutation_sample.FileSample(population, drawn))
        is None
    )


def test_sampled_files_show_their_estimate_in_the_table(mutants: Path) -> None:
    drawn = [f"{SP}1", f"{SP}2"]
    mutation_sample.write_samples(
        mutants / "sample.json",
        {"spec/hashing.py": mutation_sample.FileSample([f"{SP}{k}" for k in range(1, 11)], drawn)},
    )
    _meta(mutants, "spec/hashing.py", {f"{SP}{k}": (1 if k <= 2 else None) for k in range(1, 11)})
    text = mutation.table(mutation.read_results(mutants)[0])
    assert "| `spec/hashing.py` | 10 | 2 | 0 | 0 | 0 | 0 | 8 | 0 | ~100% (95% CI 34-100%;" in text
    assert "| **all** | 17 | 4 | 0 | 1 | 1 | 1 | 10 | 0 | 71% of 7 decided (partial) |" in text


def test_a_rebuilt_extension_is_copied_into_mutants(tmp_path: Path) -> None:
    root, mutants = tmp_path / "repo", tmp_path / "repo" / "mutants"
    so = root / "paged_engine" / "_k.so"
    so.parent.mkdir(parents=True)
    so.write_bytes(b"new build")
    assert mutation.sync_extensions(root, mutants) == [mutants / "paged_engine" / "_k.so"]
    assert (mutants / "paged_engine" / "_k.so").read_bytes() == b"new build"
    assert mutation.sync_extensions(root, mutants) == []  # the same bytes: left alone
    so.write_bytes(b"newer build")
    assert mutation.sync_extensions(root, mutants) == [mutants / "paged_engine" / "_k.so"]
    assert (mutants / "paged_engine" / "_k.so").read_bytes() == b"newer build"


def test_mutmut_runs_with_the_plugin_and_keeps_the_callers_options() -> None:
    env = mutation.mutmut_env({"PYTEST_ADDOPTS": "-x", "PYTHONPATH": "/elsewhere"})
    assert env["HYPOTHESIS_PROFILE"] == "mutation"
    assert env["PYTEST_ADDOPTS"] == "-x -p mutation_plugin"
    assert env["PYTHONPATH"].split(":") == [str(mutation.SCRIPTS), "/elsewhere"]
    assert (mutation.SCRIPTS / "mutation_plugin.py").exists()
    assert mutation.mutmut_env({})["PYTHONPATH"] == str(mutation.SCRIPTS)


def test_the_plugin_drops_only_the_shrink_and_explain_phases() -> None:
    base = settings(max_examples=7, phases=list(Phase), derandomize=True, database=None)
    fast = mutation_plugin.no_shrink(base)
    assert list(fast.phases) == [Phase.explicit, Phase.reuse, Phase.generate, Phase.target]
    assert (fast.max_examples, fast.derandomize) == (7, True)
    before = settings.get_current_profile_name()
    try:
        mutation_plugin.pytest_configure(pytest.Config.__new__(pytest.Config))
        assert settings.get_current_profile_name() == mutation_plugin.PROFILE
        loaded = settings.get_profile(mutation_plugin.PROFILE)
        assert Phase.shrink not in loaded.phases and Phase.explain not in loaded.phases
        assert loaded.max_examples == settings.get_profile(before).max_examples
    finally:
        settings.load_profile(before)
    assert settings.get_current_profile_name() == before  # the suite's profile is back
    assert Phase.shrink in settings.get_profile(before).phases


def _exits(code: int) -> object:
    def main(args: list[str], plugins: list[object]) -> int:
        import os

        if args != ["-q"] or plugins != ["plugin"]:  # no assert: this runs in the fork
            return 7
        return code if os.environ["MUTANT_UNDER_TEST"] == "m" else 100 + code

    return main


def test_a_forked_run_reports_the_mutants_exit_status_or_none_past_the_timeout() -> None:
    import time

    import mutation_recheck

    assert mutation_recheck._run_forked("m", ["-q"], 30, _exits(1), "plugin") == 1  # type: ignore[arg-type]
    assert mutation_recheck._run_forked("", ["-q"], 30, _exits(0), "plugin") == 100  # type: ignore[arg-type]

    def hangs(args: list[str], plugins: list[object]) -> int:
        time.sleep(60)
        return 0

    assert mutation_recheck._run_forked("m", [], 0.3, hangs, None) is None


def _builds_a_patch_mutant(call: ast.Call, patches: set[str]) -> bool:
    """Whether ``call`` patches a copy of the product's sources: the patch helpers
    themselves, or a mutant factory (``allocator_mutants.allocator``,
    ``scheduler_mutants.build``) given a patch mutant's name, or a name it cannot read."""
    func = ast.unparse(call.func)
    if func.rsplit(".", 1)[-1] in ("patched_copy", "patched_modules", "from_patch"):
        return True
    if not func.endswith(("allocator_mutants.allocator", "scheduler_mutants.build")):
        return False
    name = call.args[0] if call.args else None
    return not isinstance(name, ast.Constant) or name.value in patches


def test_the_selected_tests_that_patch_a_mutated_file_are_left_out_of_mutation_runs() -> None:
    """mutmut runs its test selection inside mutants/, where each mutated file is its
    trampolined copy: a patch mutant of one no longer applies there (StaleMutant), and
    mutmut's clean run fails before any mutant runs. So every selected test that builds a
    patch mutant (of the allocator or the scheduler) carries the ``source_patch`` marker,
    which ``[tool.mutmut]``'s ``-m`` leaves out."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+ (CI's)
    root = Path(__file__).resolve().parent.parent
    config = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["mutmut"]
    args = config["pytest_add_cli_args"]
    assert "not source_patch" in args[args.index("-m") + 1]
    patches = {p.stem for p in (root / "tests" / "allocator_mutants").glob("*.diff")}
    patches |= {p.stem for p in (root / "tests" / "scheduler_mutants").glob("*.patch")}
    files: list[Path] = []
    for entry in config["pytest_add_cli_args_test_selection"]:
        path = root / entry
        files += sorted(path.glob("*.py")) if path.is_dir() else [path]
    marked: list[str] = []
    unmarked: list[str] = []
    for file in files:
        for node in ast.walk(ast.parse(file.read_text())):
            if not isinstance(node, ast.FunctionDef) or not node.name.startswith("test"):
                continue
            calls = [c for c in ast.walk(node) if isinstance(c, ast.Call)]
            if any(_builds_a_patch_mutant(c, patches) for c in calls):
                has_marker = any("source_patch" in ast.unparse(d) for d in node.decorator_list)
                (marked if has_marker else unmarked).append(f"{file.name}::{node.name}")
    assert unmarked == []
    assert "test_invariants.py::test_the_memo_keyed_without_the_length_is_caught" in marked
