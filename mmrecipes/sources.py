"""Where rows come from: file specs, one stream per source split by data rank, and readers that
never crash.

`load_stream` gives a data rank its share of a source as a `datasets.IterableDataset`, one shard per
file, whose `state_dict` resumes it exactly. Parquet, JSON, CSV and webdataset files are read here,
a file at a time, because one bad file must cost its rows, not the run: `datasets`' own readers
raise on an empty parquet file, on non-UTF-8 bytes anywhere in a JSON file or a `.txt` member, and
on a first tar sample that lacks a member, and they end a truncated tar without a word. Here every
row keeps the requested columns (None where absent), and a row that could not be read becomes a row
whose `PROBLEM` column names the kind, which the preprocessors count and skip:
- `bad_shard`: an empty, unreadable or truncated file (the rows before the damage are kept);
- `bad_text`: text that is not UTF-8 (a caption, a conversation);
- `bad_row`: a JSON line that does not parse, a CSV line whose fields do not match its header.
Each of these rows also names its file in `DATA_FILE` (relative image and video paths resolve
against its folder). Other formats (imagefolder, arrow, hub datasets with a loading script) stream
through `datasets` with images left undecoded (the preprocessors decode and count).
"""

import csv
import glob
import hashlib
import json
import logging
import math
import re
import tarfile
from pathlib import Path

import datasets
import fsspec
import pyarrow.parquet as pq
from datasets.distributed import split_dataset_by_node

from .paths import is_embedded, resolve_name

logger = logging.getLogger(__name__)

PROBLEM = "__problem__"  # a column: None, or why the row could not be read
# a column: the file a row was read from (None for `datasets`' own readers)
DATA_FILE = "__data_file__"
SOURCE = "__source__"  # a column of a mixed stream: the index of the source the row came from
# A column a reader may be asked for: the row's columns it was not asked for, as JSON (those that are not JSON, such
# as image bytes, left out): what GRPO's reward functions get as keywords, as TRL passes every column
OTHER_COLUMNS = "__other_columns__"
_WARNED_SHARDS = set()  # (source, shards) already said not to divide the data ranks
_BAD_TEXT = re.compile("[\udc80-\udcff]")  # what undecodable bytes become under surrogateescape


def expand_data_files(spec: str | list[str] | None) -> list[str] | None:
    """`--data_files` as `load_dataset` takes it: comma-separated entries (or a list), each with its
    brace ranges expanded as open_clip/webdataset users write them (`/data/{00000..41455}.tar`, zero
    padding kept; `{a,b}` alternatives too). Globs and fsspec URLs (chains too) pass through to
    `datasets`; open_clip's `A::B` is refused."""
    if not spec:
        return None
    if not isinstance(spec, str):
        return [path for entry in spec for path in expand_data_files(entry)]
    entries, depth, current = [], 0, ""
    for char in spec:  # split on commas outside braces
        depth += {"{": 1, "}": -1}.get(char, 0)
        if char == "," and depth == 0:
            entries.append(current)
            current = ""
        else:
            current += char
    entries = [entry.strip() for entry in entries + [current] if entry.strip()]
    for entry in entries:
        # fsspec's chains start with a protocol
        if "::" in entry and "://" not in entry.split("::")[0]:
            raise ValueError(f"data files {entry!r}: '::' joins sources in open_clip (A::B), but fsspec reads it as a "
                             "URL chain and would read A only; separate the files with commas (one source, read in "
                             "turn), or mix sources by weight: each source's files in a directory of its own, "
                             "--dataset_name 'dirA,dirB' --dataset_weights '0.75,0.25'")
    return [path for entry in entries for path in _expand_braces(entry)]


def _expand_braces(pattern: str) -> list[str]:
    match = re.search(r"\{([^{}]*)\}", pattern)
    if match is None:
        return [pattern]
    head, body, tail = pattern[:match.start()], match.group(1), pattern[match.end():]
    numeric = re.fullmatch(r"(\d+)\.\.(\d+)", body)
    if numeric:
        first, last = numeric.groups()
        width = len(first) if first.startswith("0") and len(first) > 1 else 0
        step = 1 if int(last) >= int(first) else -1
        choices = [f"{i:0{width}d}" for i in range(int(first), int(last) + step, step)]
    elif "," in body:
        choices = body.split(",")
    else:
        return [head + "{" + body + "}" + path for path in _expand_braces(tail)]  # a literal brace
    return [path for choice in choices for path in _expand_braces(head + choice + tail)]


def data_fingerprint(sources: list[tuple]) -> list[str]:
    """What identifies each (name, config, split, data_files) source across runs: for local data the
    names and sizes of its files (so a moved copy matches and another dataset does not), else the
    spec itself."""
    prints = []
    for name, config, split, data_files in sources:
        name = resolve_name(name)
        patterns = expand_data_files(data_files) or ([f"{name}/**"] if Path(name).is_dir() else [])
        files = sorted({Path(path) for pattern in patterns for path in glob.glob(pattern, recursive=True)
                        if Path(path).is_file() and not any(part.startswith(".") for part in Path(path).parts[-2:])})
        if not files:
            prints.append(f"{name} config={config} split={split} data_files={data_files}")
            continue
        listing = hashlib.sha256(json.dumps([[path.name, path.stat().st_size] for path in files]).encode())
        prints.append(f"config={config} split={split}: {len(files)} files, "
                      f"{sum(path.stat().st_size for path in files)} bytes, names and sizes {listing.hexdigest()[:16]}")
    return prints


def split_by_data_rank(stream, name: str, data_rank: int, data_world: int):
    """This data rank's share of a stream. Whole shards when their number is a multiple of the data
    world; otherwise `split_dataset_by_node` has every rank read every shard and keep 1/W of its
    rows, which multiplies the read traffic by W: said once in the log, with what to do."""
    # once: the evaluation and prompt streams read a source again
    said = (name, stream.num_shards, data_world)
    if data_world > 1 and stream.num_shards % data_world and data_rank == 0 and said not in _WARNED_SHARDS:
        _WARNED_SHARDS.add(said)
        logger.warning(f"{name}: {stream.num_shards} shards over {data_world} data ranks, not a multiple: every rank "
                       f"reads every shard and keeps 1/{data_world} of its rows ({data_world}x the read traffic). "
                       f"Split the data into a multiple of {data_world} files to give each rank whole shards.")
    return split_dataset_by_node(stream, rank=data_rank, world_size=data_world)


def _parquet_rows(file: str):
    with fsspec.open(file, "rb") as stream:
        for batch in pq.ParquetFile(stream).iter_batches():
            # an image column: {"bytes", "path"} or plain bytes (img2dataset)
            yield from batch.to_pylist()


def _json_rows(file: str):
    """A JSON array (LLaVA's files: read whole) or JSON lines (read a line at a time); undecodable
    bytes become `bad_text` rows, lines that do not parse `bad_row` rows."""
    with fsspec.open(file, "rb", compression="infer") as stream:
        if stream.read(4096).lstrip().startswith(b"["):
            stream.seek(0)
            rows = json.loads(stream.read().decode("utf-8", errors="surrogateescape"))
        else:
            stream.seek(0)
            rows = (_json_line(line) for line in stream if line.strip())
        for row in rows:
            yield row if isinstance(row, dict) else {PROBLEM: "bad_row"}


def _json_line(line: bytes):
    try:
        return json.loads(line.decode("utf-8", errors="surrogateescape"))
    # nested deeper than Python's stack: this line, not the rest of the file
    except (ValueError, RecursionError):
        return {PROBLEM: "bad_row"}


def _csv_rows(file: str):
    """A CSV file with a header row (values as text); a line with more or fewer fields than the
    header is a `bad_row` row (pandas, `datasets`' reader, stops the run there naming neither the
    file nor the line)."""
    with fsspec.open(file, "rt", compression="infer", encoding="utf-8", errors="surrogateescape", newline="") as text:
        lines = csv.reader(text)
        header = next(lines, None)
        for fields in lines:
            if fields:  # not a blank line
                yield dict(zip(header, fields)) if len(fields) == len(header) else {PROBLEM: "bad_row"}


def _tar_rows(file: str):
    """webdataset / img2dataset tars: members `<key>.<field>` grouped by key in order. `.txt`
    members become strings (non-UTF-8 ones make the sample a `bad_text` row), `.json` ones objects,
    others bytes."""
    sample = {}
    with fsspec.open(file, "rb") as stream, tarfile.open(fileobj=stream, mode="r|*") as tar:
        yield from _tar_samples(tar, sample)
        # tarfile ends quietly where a cut falls inside a member's header: a whole archive ends with two zero blocks
        if getattr(tar.fileobj, "comptype", "tar") == "tar" and stream.size - tar.offset < 2 * tarfile.BLOCKSIZE:
            raise tarfile.ReadError(f"the archive ends inside a member header, {stream.size - tar.offset} bytes after "
                                    "its last whole member (truncated)")
    if sample:
        yield sample


def _tar_samples(tar, sample: dict):
    """The samples of `tar` but its last, left in `sample` (the caller yields it once the archive
    proves whole)."""
    for member in tar:
        if not member.isfile() or "." not in Path(member.name).name:
            continue
        directory, name = member.name.rpartition("/")[::2]
        key, field = f"{directory}/{name.split('.', 1)[0]}", name.split(".", 1)[1].lower()
        if sample and sample["__key__"] != key:
            yield dict(sample)
            sample.clear()
        sample["__key__"] = key
        # a member cut short raises ReadError: the shard is truncated
        data = tar.extractfile(member).read()
        if field.endswith(("txt", "json")):
            try:
                data = data.decode("utf-8")
                data = json.loads(data) if field.endswith("json") else data
            except ValueError:  # UnicodeDecodeError too
                sample[PROBLEM] = "bad_text" if isinstance(data, bytes) else "bad_row"
        sample[field] = data


READERS = {"parquet": _parquet_rows, "json": _json_rows, "csv": _csv_rows, "webdataset": _tar_rows}


def _has_bad_text(value) -> bool:
    if isinstance(value, str):
        return _BAD_TEXT.search(value) is not None
    if isinstance(value, dict):
        return any(_has_bad_text(item) for item in value.values())
    if isinstance(value, list):
        return any(_has_bad_text(item) for item in value)
    return False


def read_files(files: list[str], reader: str, columns: list[str]):
    """Rows of `files` (the generator behind `load_stream`): `columns` and `PROBLEM`; an empty file,
    or a file's failure after the rows read before it, one `bad_shard` row."""
    for file in files:
        rows, damaged = 0, False
        try:
            for row in READERS[reader](file):
                rows += 1
                problem = row.get(PROBLEM) or ("bad_text" if _has_bad_text(row) else None)
                yield (dict.fromkeys(columns) if problem else _selected(row, columns)) | {PROBLEM: problem,
                                                                                          DATA_FILE: file}
        # whatever a damaged file raises (pyarrow, tarfile, json, fsspec)
        except Exception as error:
            logger.warning("skipping the rest of %s after %d rows: %s: %s", file, rows, type(error).__name__, error)
            damaged = True
        if damaged or not rows:
            yield dict.fromkeys(columns) | {PROBLEM: "bad_shard", DATA_FILE: file}


def resolve_source(name: str, config: str | None, split: str, data_files) -> tuple[str, list[str] | None]:
    """(builder, files of `split`) as `datasets` resolves them (a builder name with files, a local
    dataset directory or a hub id); files None for a source without data files (a loading
    script)."""
    files = expand_data_files(data_files)
    builder = datasets.load_dataset_builder(name, config, data_files={split: files} if files else None)
    resolved = (builder.config.data_files or {}).get(split)
    return builder.name, (list(resolved) if resolved is not None else None)


def load_stream(name: str, config: str | None, split: str, data_files, columns: list[str], *, data_rank: int,
                data_world: int) -> tuple[datasets.IterableDataset, list[str] | None]:
    """(stream, the columns the source has, None if it has no readable row): this data rank's share
    of a source's split. Every row holds exactly `columns` (images undecoded), `PROBLEM` and
    `DATA_FILE`."""
    name = resolve_name(name)
    builder, files = resolve_source(name, config, split, data_files)
    if builder in READERS and files:
        first = next((row for file in files for row in _first_row(builder, file)), None)
        stream = datasets.IterableDataset.from_generator(read_files, gen_kwargs={"files": files, "reader": builder,
                                                                                "columns": tuple(columns)})
        available = sorted(first) if first is not None else None
    else:
        stream = datasets.load_dataset(name, config, data_files={split: files} if files else None, split=split,
                                       streaming=True)
        if stream.features is not None:  # csv streams with unknown features: nothing to decode
            stream = stream.decode(False)  # images: decoded and counted by us
        available = stream.column_names
        stream = stream.map(_only, fn_kwargs={"columns": columns}, remove_columns=available)
    return split_by_data_rank(stream, name, data_rank, data_world), available


# an evaluation flag's default: the embedded held-out set beside the embedded training data only
AUTO = "auto"


def evaluation_source(flag: str, name: str | None, data_files, training: str, embedded_set: str) -> tuple:
    """(the source an evaluation reads, or None: off; the line that says which). `name` is
    --`flag`'s value: a name asks for that source (an embedded one too), None turns it off, and
    `AUTO` means `embedded_set` when the training data (`training`, --dataset_name) is the embedded
    data, else the `data_files` given for it (read by the training source's builder), else nothing:
    a run on the user's own data never reports the embedded set as if it measured theirs."""
    if not name:
        return None, f"--{flag} is off"
    if name != AUTO:
        return name, f"--{flag} {name}" + (f" (files {data_files})" if data_files else "")
    names = [source.strip() for source in training.split(",")]
    if data_files:
        if len(names) > 1:
            raise ValueError(f"--{flag} auto reads its files with the training source's builder, but there are "
                             f"{len(names)} training sources: name the builder (e.g. --{flag} json)")
        return names[0], f"--{flag} {names[0]} (files {data_files})"
    if all(is_embedded(source) for source in names):
        return embedded_set, f"--{flag} {embedded_set} (the embedded held-out set, beside the embedded training data)"
    return None, (f"--{flag} is off: you train on your own data and name no held-out data for it; the embedded set "
                  f"is evaluated only beside the embedded training data, or when named (--{flag} {embedded_set})")


def split_sources(dataset_name: str, config: str | None, split: str, data_files) -> list[tuple]:
    """(name, config, split, data_files) of each comma-separated `--dataset_name` source."""
    names = [name.strip() for name in dataset_name.split(",")]
    if data_files and len(names) > 1:
        raise ValueError("--data_files goes with a single --dataset_name source (a builder such as json or parquet)")
    return [(name, config, split, data_files) for name in names]


def source_weights(weights: str | None, sources: int, explicit: bool = False) -> list[float]:
    """The sampling probability of each of `sources` from --dataset_weights (None: equal). Weights
    must be finite, 0 or more, not all 0, one per source; given `explicit`ly for a single source
    they would do nothing, and are refused rather than ignored (a default weighting is ignored
    there)."""
    try:
        values = [float(weight) for weight in weights.split(",")] if weights else [1.0] * sources
    except ValueError:
        values = []
    if sources == 1 and not explicit:
        return [1.0]
    if len(values) != sources or not all(math.isfinite(value) and value >= 0 for value in values) or not sum(values):
        hint = " (one source: nothing to mix, drop --dataset_weights)" if sources == 1 else ""
        raise ValueError(f"--dataset_weights {weights!r}: give one finite weight, 0 or more, per --dataset_name source "
                         f"({sources}){hint}")
    return values


def mixed_stream(sources: list[tuple], weights: str | None, columns: list[str], *, data_rank: int, data_world: int,
                 seed: int, check_columns=None, tag_sources=False) -> datasets.IterableDataset:
    """This data rank's rows of `sources` ((name, config, split, data_files) each) mixed at
    `weights` (comma-separated sampling probabilities, None: equal) by
    `datasets.interleave_datasets`: every rank sees the same mixture in expectation, an epoch ends
    once every source has been read once, and the stream's `state_dict` resumes it exactly.
    `tag_sources`: with several sources each row names its own in `SOURCE` (for per-source counts; a
    checkpoint's stream position depends on it). `check_columns(name, available)` may refuse a
    source before the first step."""
    probabilities = source_weights(weights, len(sources))
    streams = []
    for index, (name, config, split, data_files) in enumerate(sources):
        stream, available = load_stream(name, config, split, data_files, columns, data_rank=data_rank,
                                        data_world=data_world)
        if check_columns is not None:
            check_columns(name, available)
        streams.append(stream.map(_tagged, fn_kwargs={"index": index}) if tag_sources and len(sources) > 1 else stream)
    if len(streams) == 1:
        return streams[0]
    # Columns a source lacks are filled with None (so formats may differ).
    return datasets.interleave_datasets(streams, probabilities=[p / sum(probabilities) for p in probabilities],
                                        seed=seed, stopping_strategy="all_exhausted")


def row_name(row: dict) -> str:
    """How a skip report names a row: its `id` column and its file, where known."""
    name = f"row {row['id']!r}" if isinstance(row.get("id"), (str, int)) else "a row"
    return f"{name} of {row[DATA_FILE]}" if row.get(DATA_FILE) else name


def _tagged(row: dict, index: int) -> dict:
    return {SOURCE: index}


def _only(row: dict, columns: list[str]) -> dict:
    return _selected(row, columns) | {PROBLEM: None, DATA_FILE: None}


def _selected(row: dict, columns) -> dict:
    """`columns` of `row` (None where absent), `OTHER_COLUMNS` as the rest of it in JSON where asked
    for."""
    selected = {column: row.get(column) for column in columns}
    if OTHER_COLUMNS in columns:
        selected[OTHER_COLUMNS] = json.dumps({key: value for key, value in row.items()
                                              if key not in columns and not key.startswith("__") and _is_json(value)})
    return selected


def _is_json(value) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def _first_row(reader: str, file: str):
    """The first row of a file, to check the columns before the first step ([] if it has none)."""
    try:
        yield next(READERS[reader](file))
    except Exception:  # an empty or damaged file: the stream counts it; look at the next one
        return
