"""The benchmark flags of the VLM recipes (`--benchmarks`), importable before torch loads."""

from dataclasses import dataclass

from ..config import CheckedArgs, checked
from .tasks import TASKS


@dataclass
class BenchmarkArgs(CheckedArgs):
    # comma-separated built-in tasks, scored as lmms-eval 0.7.3 scores them
    # (mmrecipes.benchmarks.tasks.TASKS)
    benchmarks: str = ""
    # the first N documents of each task (lmms-eval's --limit)
    benchmark_limit: int = checked(0, "count_or_zero")
    # every K optimizer steps besides the end of the run; 0: at the end only
    benchmark_steps: int = checked(0, "count_or_zero")
    # local copies of the tasks' data: DIR/<task>/*.parquet with the hub dataset's columns
    # (embedded:benchmarks: the embedded fixture tasks); "": the hub datasets lmms-eval reads
    benchmark_data_dir: str = ""
    # at most this many answer tokens (0: each task's own generation_kwargs): a cap changes scores,
    # and says so
    benchmark_max_new_tokens: int = checked(0, "count_or_zero")

    def __post_init__(self):
        super().__post_init__()
        self.names()  # an unknown task stops the run when the flags are parsed

    def names(self) -> list[str]:
        names = [name.strip() for name in self.benchmarks.split(",") if name.strip()]
        if unknown := [name for name in names if name not in TASKS]:
            raise ValueError(f"--benchmarks: no built-in task {', '.join(unknown)}; the tasks: {', '.join(TASKS)}")
        if repeated := sorted({name for name in names if names.count(name) > 1}):
            raise ValueError(f"--benchmarks: {', '.join(repeated)} named twice; each task is answered once")
        return names
