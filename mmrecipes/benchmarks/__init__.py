"""Standard benchmarks scored as lmms-eval scores them, in the training loop or on a saved model.

- `tasks`: the built-in rule-scored tasks (prompt, answer length, scorer, aggregation), each as
  lmms-eval 0.7.3's;
- `scoring`: its answer parsers and scorers;
- `arguments`: `BenchmarkArgs`, the recipes' `--benchmarks` flags;
- `harness`: `Benchmarks` (documents strided over the ranks, answered in step, scores gathered
  once);
- `python -m mmrecipes.benchmarks --model outputs/vlm_finetune --benchmarks mmstar`: a saved model,
  by `generate`.
"""
