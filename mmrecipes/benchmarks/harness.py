"""Benchmark tasks scored as lmms-eval scores them, their documents sharded over the ranks
(`Benchmarks`).

Each task's documents (the first `--benchmark_limit`, as lmms-eval's `--limit`) are strided over the
ranks, as lmms-eval strides them; every rank answers as many times as the rank with the most (a rank
past its own answers a filler and drops it), so a sharded model's collectives stay in step; the
scores are gathered once per task and every rank computes the same numbers from them, in document
order. Answers come from a callable the caller gives (`answer(request, max_new_tokens)`: the
recipes' greedy decoding in step over the ranks, or `generate` for a saved model), so this package
holds no model code; a rank past its documents gives it a filler request (`Request.filler`). An
answerer may refuse a request before it forwards anything (`answer.refusal(request)`: a prompt
longer than the model reads); the filler is answered in its place. A task whose documents are clips
(LibriSpeech) needs an answerer that hears (`answer.sampling_rate`: its feature extractor's rate,
the rate the clips are decoded at, with PyAV as the recipes decode theirs); another is refused
before the first step.

A document that cannot be scored is counted by reason and named in the log, never scored 0: a
missing value, an image or clip that does not decode, a scorer that raises on it (`unscorable`: a value of
another form than the task's). An answer the task's parser cannot read scores 0, as in lmms-eval,
and is counted (`unread`). Nothing a document holds ends the run: a benchmark at the last step never
costs the trained model. A task that would read no document, a column of the wrong type, an unknown
or repeated task or a dataset without a column the task reads stops the run before its first step.
"""

import json
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

import datasets
import torch.distributed as dist
from PIL import Image

from ..audio import decode_audio
from ..images import decode_image
from ..paths import resolve_name
from ..reporting import Evaluation
from ..skips import Skip
from .arguments import BenchmarkArgs
from .tasks import LMMS_EVAL, TASKS, Task

MAX_ERRORS_SAID = 3  # a task's scorer errors named in the log, per rank
MAX_CLIP_SECONDS = 600.0  # a longer clip is counted (audio_too_long), from its header where it can


@dataclass(frozen=True)
class Request:
    """One document to answer: one user turn of its images or clips (mono float32 at the answerer's
    `sampling_rate`), then its prompt. A `filler` is answered only to stay in step with ranks that
    have a document left (its answer is dropped: an answerer without collectives may skip it)."""

    index: int
    messages: list
    images: list
    filler: bool = False
    clips: list = ()


def too_long(prompt_tokens: int, config) -> str | None:
    """"too_long" where a prompt alone runs past the positions the language model reads (a model
    `config`'s): refused before the model sees it (a 1 MB question was decoded for hours), else
    None. Its answer may run past them, as in lmms-eval (most models stop long before
    `max_new_tokens`)."""
    positions = getattr(config.get_text_config(), "max_position_embeddings", None)
    return "too_long" if positions and prompt_tokens > positions else None


class Benchmark:
    """One task's documents, the ones this rank answers, and its answers' limit."""

    def __init__(self, task: Task, docs, rank: int, world: int, cap: int, source: str):
        self.task, self.docs, self.rank, self.world, self.source = task, docs, rank, world, source
        self.max_new_tokens = min(task.max_new_tokens, cap) if cap else task.max_new_tokens

    @classmethod
    def load(cls, task: Task, args: BenchmarkArgs, rank: int, world: int) -> "Benchmark":
        folder = Path(resolve_name(args.benchmark_data_dir)) / task.name if args.benchmark_data_dir else None
        try:
            docs = (datasets.load_dataset("parquet", data_files=str(folder / "*.parquet"), split="train") if folder
                    else datasets.load_dataset(task.dataset, task.subset, split=task.split))
        except (ValueError, FileNotFoundError, datasets.exceptions.DatasetGenerationError) as error:
            # no file, files without a row, a file without a column
            raise ValueError(f"--benchmarks {task.name}: no document to score ({type(error).__name__}: {error}): the "
                             "benchmark would never run") from error
        if missing := [column for column in task.reads if column not in docs.column_names]:
            raise ValueError(f"--benchmarks {task.name}: its documents have no {', '.join(missing)} column (lmms-eval "
                             f"reads {task.hub})")
        # a string read as a list would be its characters: silent, wrong scores
        for column in task.lists:
            if not isinstance(docs.features[column], (datasets.List, datasets.LargeList)):
                raise ValueError(f"--benchmarks {task.name}: its {column} column holds {docs.features[column]}, not "
                                 f"a list (lmms-eval reads a list of {column} from {task.hub})")
        # decoded per document: a bad one counts
        for column in (*task.image_columns, *task.audio_columns):
            if isinstance(docs.features[column], datasets.Image):
                docs = docs.cast_column(column, datasets.Image(decode=False))
            if isinstance(docs.features[column], datasets.Audio):
                docs = docs.cast_column(column, datasets.Audio(decode=False))
        if args.benchmark_limit:
            docs = docs.select(range(min(args.benchmark_limit, len(docs))))
        if not len(docs):
            raise ValueError(f"--benchmarks {task.name}: no document to score: the benchmark would never run")
        return cls(task, docs, rank, world, args.benchmark_max_new_tokens, str(folder) if folder else task.hub)

    def slots(self) -> int:
        """How many answers every rank gives: the most any rank has."""
        return -(-len(self.docs) // self.world)

    def request(self, index: int, sampling_rate: int | None = None, clip_seconds: float | None = None):
        """(the document's row, what to answer, its clips at `sampling_rate`), or `Skip` (a clip over
        `clip_seconds`, the longest the answerer reads, or over `MAX_CLIP_SECONDS`: audio_too_long)."""
        doc = self.docs[index]
        if missing := [column for column in self.task.columns if doc[column] is None]:
            raise Skip(f"missing_{missing[0]}")
        visuals = self.task.visuals(doc)
        if missing := [column for column in visuals if doc.get(column) is None]:
            raise Skip(f"missing_{missing[0]}")
        images, clips = [], []
        # the project's decoders: a FIFO or device is refused, never opened
        for column in visuals:
            if column in self.task.audio_columns:
                clip, problem = decode_audio(doc[column], sampling_rate, min(MAX_CLIP_SECONDS,
                                                                             clip_seconds or MAX_CLIP_SECONDS))
                if clip is None:
                    raise Skip(problem)
                clips.append(clip)
                continue
            image, problem = decode_image(doc[column], Image.MAX_IMAGE_PIXELS)
            if image is None:
                raise Skip(f"{problem}_image")
            images.append(image)
        turn = [{"role": "user", "content": self.task.turn(doc)}]
        return doc, Request(index, turn, images, clips=clips)

    def answerable(self, index: int, answer) -> tuple[dict, Request]:
        """(the document's row, what to answer), or `Skip`: as `request`, and not refused by the
        answerer."""
        doc, request = self.request(index, getattr(answer, "sampling_rate", None),
                                    getattr(answer, "clip_seconds", None))
        refusal = getattr(answer, "refusal", None)
        if refusal is not None and (reason := refusal(request)):
            raise Skip(reason)
        return doc, request

    def filler(self, answer) -> Request | None:
        """The first document that can be answered, as a filler (the same on every rank; None if
        none can)."""
        for index in range(len(self.docs)):
            try:
                return replace(self.answerable(index, answer)[1], filler=True)
            except Skip:
                continue
        return None

    def run(self, answer) -> tuple[list, Counter, list]:
        """This rank's (document index, `Scored`), its counts of documents not scored, by reason,
        and the first errors of a scorer that raised (document index, why)."""
        scored, skipped, errors, filler = [], Counter(), [], self.filler(answer)
        mine = list(range(self.rank, len(self.docs), self.world))
        for slot in range(self.slots()):
            doc = request = None
            if slot < len(mine):
                try:
                    doc, request = self.answerable(mine[slot], answer)
                except Skip as skip:
                    skipped[skip.reason] += 1
            # no document of the task can be answered, on any rank: nothing to stay in step with
            if filler is None:
                continue
            text = answer(request or filler, self.max_new_tokens)
            if request is None:
                continue
            try:
                scored.append((request.index, self.task.read(doc, text)))
            except Exception as error:  # noqa: BLE001 (a value of another form than the task's: counted and named)
                skipped["unscorable"] += 1
                errors.append((request.index, f"{type(error).__name__}: {error}"))
        return scored, skipped, errors[:MAX_ERRORS_SAID]


class Benchmarks:
    """The tasks of `--benchmarks`, loaded before the first step (`data_rank`, `data_world`: the
    ranks that share the documents, `Ranks.reads(evaluation=True)`: under sequence parallelism every
    process answers its own)."""

    def __init__(self, args: BenchmarkArgs, data_rank: int = 0, data_world: int = 1, say=print):
        self.args, self.say = args, say
        self.tasks = [Benchmark.load(TASKS[name], args, data_rank, data_world) for name in args.names()]
        # {task: (its numbers, scored documents, unread, skipped)} of the last run
        self.results = {}
        self.rendering = ""  # what the answerer's chat template is given (--chat_template_kwargs), said with the tasks

    def __bool__(self) -> bool:
        return bool(self.tasks)

    def evaluation(self, answer, say=print) -> Evaluation:
        """The tasks as an evaluation of the run (`reporting.Evaluation`), said now (`describe`):
        every --benchmark_steps and at the run's last step, answered by `answer` (`Request` -> text:
        the recipes' `BenchmarkAnswers`, whose `template_kwargs` are said beside the tasks and
        their numbers); their main metrics plotted in the model card, their numbers written there."""
        self.check_answerer(answer)
        self.rendered_with(answer)
        say(self.describe())
        return Evaluation([lambda filler: self.run(answer)] if self.tasks else [], every=self.args.benchmark_steps,
                          curves=self.metrics(), card=self.card_lines)

    def check_answerer(self, answer):
        """Refuse a task of clips where `answer` does not hear (no `sampling_rate`): its prompts would
        be answered without their sound."""
        deaf = [bench.task.name for bench in self.tasks if bench.task.hears]
        if deaf and getattr(answer, "sampling_rate", None) is None:
            raise ValueError(f"--benchmarks {', '.join(deaf)}: its documents are audio clips, and the "
                             "model does not hear (no audio tower, or a processor without a feature "
                             "extractor): leave the task out")

    def rendered_with(self, answer):
        """Say beside the tasks and their numbers what `answer`'s chat template is given (its
        `template_kwargs`: --chat_template_kwargs, a think mode)."""
        kwargs = getattr(answer, "template_kwargs", None)
        self.rendering = (f"; prompts rendered with {json.dumps(kwargs, sort_keys=True)} (--chat_template_kwargs)"
                          if kwargs else "")

    def describe(self) -> str:
        if not self.tasks:
            return "benchmarks: none (--benchmarks)"
        tasks = ", ".join(f"{bench.task.name} ({len(bench.docs)} documents, answers of at most "
                          f"{bench.max_new_tokens} tokens)" for bench in self.tasks)
        capped = " (--benchmark_max_new_tokens caps them: not lmms-eval's scores)" if any(
            bench.max_new_tokens < bench.task.max_new_tokens for bench in self.tasks) else ""
        return (f"benchmarks, as lmms-eval {LMMS_EVAL} scores them, greedy, each answer read after its reasoning (the "
                f"<think> and <analysis> blocks its command line takes out): {tasks}{capped}{self.rendering}")

    def run(self, answer) -> dict:
        """Every task answered and scored: {`bench/<task>/<metric>`: value} for the log, counts
        included."""
        self.check_answerer(answer)
        scores = {}
        for bench in self.tasks:
            name = bench.task.name
            scored, skipped = self._gathered(bench, bench.run(answer))
            numbers = self._numbers(bench, scored, skipped)
            unread = sum(not result.read for _, result in scored)
            self.results[name] = (numbers, len(scored), unread, skipped)
            main = {bench.task.main: numbers[bench.task.main]} if bench.task.main in numbers else {}
            scores |= {f"bench/{name}/{metric.replace(' ', '_')}": value
                       for metric, value in (main | numbers).items()}
            scores |= {f"bench/{name}/documents": len(scored), f"bench/{name}/unread": unread,
                       **{f"bench/{name}/{reason}": count for reason, count in sorted(skipped.items())}}
        return scores

    def _gathered(self, bench: Benchmark, local: tuple) -> tuple[list, Counter]:
        """Every rank's (document, `Scored`) in document order and the counts of documents not
        scored (a collective once per task: every rank gets every score); a scorer's errors said
        with their documents."""
        parts = [local]
        if dist.is_initialized() and dist.get_world_size() > 1:
            parts = [None] * dist.get_world_size()
            dist.all_gather_object(parts, local)
        scored = sorted((item for part, _, _ in parts for item in part), key=lambda item: item[0])
        skipped = sum((counts for _, counts, _ in parts), Counter())
        if errors := sorted(error for _, _, part in parts for error in part)[:MAX_ERRORS_SAID]:
            self._say(f"benchmark {bench.task.name}: {skipped['unscorable']} documents could not be scored "
                      "(unscorable), left out of its numbers: " + "; ".join(f"document {index}: {why}"
                                                                             for index, why in errors))
        return scored, skipped

    def _numbers(self, bench: Benchmark, scored: list, skipped: Counter) -> dict:
        """The task's numbers, or none (said) where no document was scored or they cannot be
        aggregated."""
        if not scored:
            self._say(f"benchmark {bench.task.name}: no document was scored (" + ", ".join(
                f"{reason} {count}" for reason, count in sorted(skipped.items())) + "): no numbers")
            return {}
        try:
            return bench.task.numbers([result.metrics for _, result in scored])
        except Exception as error:  # noqa: BLE001 (scores of another form than the task's: said, no numbers)
            self._say(f"benchmark {bench.task.name}: its numbers could not be aggregated ({type(error).__name__}: "
                      f"{error})")
            return {}

    def _say(self, line: str):
        """Once, on the first rank: every rank holds the same gathered scores."""
        if not dist.is_initialized() or dist.get_rank() == 0:
            self.say(line)

    def metrics(self) -> list[str]:
        """The main metric's log name of each task (the curves)."""
        return [f"bench/{bench.task.name}/{bench.task.main}" for bench in self.tasks]

    def card_lines(self) -> list[str]:
        """The last run's numbers, each task with its version and documents, for the model card."""
        lines = []
        for bench in self.tasks:
            if bench.task.name not in self.results:
                continue
            numbers, documents, unread, skipped = self.results[bench.task.name]
            shown = ", ".join(f"{metric} {value:.4f}" for metric, value in numbers.items())
            counts = "".join(f", {reason} {count}" for reason, count in sorted(skipped.items()))
            lines.append(f"- {bench.task.name} (lmms-eval {LMMS_EVAL}'s task, version {bench.task.version}; "
                         f"{bench.source}): {shown}; {documents} documents scored, {unread} answers "
                         f"unread{counts}{self.rendering}")
        return lines
