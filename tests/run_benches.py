"""Run several bench/ scripts in one Python process, one after another (tests/test_bench.py): they share
the start-up and the imports of torch, transformers and datasets, which cost more than a toy-size run.

    python tests/run_benches.py OUT_DIR SCRIPT [ARGS ...] -- SCRIPT [ARGS ...] -- ...

For script number I: OUT_DIR/I.jsonl is its --results file, OUT_DIR/I.log its output, and OUT_DIR/I.rc
its exit status (1 with the traceback in the log if it raised); stdout gets each script's seconds.
"""

import contextlib
import runpy
import sys
import time
import traceback
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def main():
    out_dir, rest = Path(sys.argv[1]), sys.argv[2:]
    runs, current = [], []
    for arg in rest + ["--"]:
        if arg == "--":
            runs.append(current)
            current = []
        else:
            current.append(arg)
    sys.path.insert(0, str(BENCH))  # what running the script directly puts first
    for index, (script, *args) in enumerate(run for run in runs if run):
        sys.argv = [str(BENCH / script), *args, "--results", str(out_dir / f"{index}.jsonl")]
        status, start = 0, time.perf_counter()
        with open(out_dir / f"{index}.log",
                  "w") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            try:
                runpy.run_path(str(BENCH / script), run_name="__main__")
            except SystemExit as exit_:
                status = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
                if not isinstance(exit_.code, int) and exit_.code is not None:
                    print(exit_.code)
            except Exception:
                traceback.print_exc()
                status = 1
        (out_dir / f"{index}.rc").write_text(str(status))
        print(script, *args, f"{time.perf_counter() - start:.1f} s", flush=True)


if __name__ == "__main__":
    main()
