"""Token mixers that keep packed samples apart: a linear-attention layer's chunked gated delta rule
and its short causal convolution, each given every token's segment (`segment_ids`: the sample it
belongs to in a packed row), equal to running every sample alone.

transformers' torch path of Qwen3.5's Gated DeltaNet (`torch_chunk_gated_delta_rule`,
`causal_conv1d_fn`) takes no sample boundaries: on a packed row the recurrent state and the
convolution's window run from one sample into the next. Here the same chunk algorithm keeps its
terms within a sample:
- inside a chunk, a token attends (and its delta-rule update system reads) only the tokens of its
  own segment before it: the pairwise decays of two segments are masked to 0, so the triangular
  system is block diagonal by segment;
- the state carried into a chunk belongs to the segment of the chunk before's last token: only the
  tokens of that segment read it (the query's read and the delta rule's correction), and it is
  carried on only when the chunk's last token is of that segment too;
- the state a chunk hands on holds the updates of its last segment only.
The convolution adds a tap `x[t - k]` only where that token is of `t`'s segment. Each equals the
samples run alone (tests/test_packing.py), at about the cost of the unmasked path.

Where flash-linear-attention and causal-conv1d are installed (transformers routes the layers' calls
to them) and the tensors are on a GPU, the kernels get the segments their way (`cu_seqlens`,
`seq_idx`), once a probe on that device finds that they then equal the torch path; otherwise the
torch path runs, and the log says why.
"""

import dataclasses
import functools
import importlib.util
import inspect
import logging
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

from .families import stateful_mixer_classes

logger = logging.getLogger(__name__)


def segment_ids(sample_lengths: torch.Tensor, shape) -> torch.Tensor:
    """Each token's segment, `[rows, length]`: the index of its sample among a packed batch's
    `sample_lengths` (every sample, and every row's padding, in row order)."""
    segments = torch.arange(len(sample_lengths), device=sample_lengths.device)
    return segments.repeat_interleave(sample_lengths).reshape(shape)


def segment_causal_conv1d(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                          segments: torch.Tensor) -> torch.Tensor:
    """A depthwise causal convolution, `[rows, channels, length]` in and out (`weight`: `[channels,
    taps]`), whose window never reaches into an earlier segment (`segments`: `[rows, length]`)."""
    taps, length = weight.shape[-1], hidden.shape[-1]
    out = hidden.new_zeros(hidden.shape, dtype=weight.dtype) if bias is None else bias[None, :, None].expand(
        hidden.shape[0], -1, length).to(weight.dtype)
    source = hidden.to(weight.dtype)
    # tap `back`: the token `back` places earlier, weighted by weight[:, taps - 1 - back]
    for back in range(taps):
        shifted = F.pad(source, (back, 0))[..., :length]
        same = F.pad(segments, (back, 0), value=-1)[..., :length] == segments
        out = out + shifted * same[:, None] * weight[:, taps - 1 - back, None]
    return out


def segment_chunk_gated_delta_rule(query, key, value, g, beta, segments: torch.Tensor, *, chunk_size: int = 64,
                                   use_qk_l2norm_in_kernel: bool = False) -> torch.Tensor:
    """The gated delta rule of `[rows, length, heads, dim]` queries, keys and values (`g`: log
    decays, `beta`: write strengths, `[rows, length, value heads]`), chunk by chunk, each token's
    read and write within its segment (`segments`: `[rows, length]`); the output `[rows, length,
    value heads, value dim]`, in the inputs' dtype."""
    dtype = query.dtype
    rows, length, key_heads, key_dim = key.shape
    value_heads, value_dim = value.shape[-2:]
    if key_heads != value_heads:  # each query/key head serves consecutive value heads
        query, key = (x.repeat_interleave(value_heads // key_heads, dim=2) for x in (query, key))
    query, key, value, beta, g = (x.transpose(1, 2).float() for x in (query, key, value, beta, g))
    if use_qk_l2norm_in_kernel:
        query, key = (x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6) for x in (query, key))
    query = query * query.shape[-1] ** -0.5
    pad = (chunk_size - length % chunk_size) % chunk_size
    query, key, value = (F.pad(x, (0, 0, 0, pad)) for x in (query, key, value))
    beta, g = (F.pad(x, (0, pad)) for x in (beta, g))
    segments = F.pad(segments, (0, pad), value=-1)  # the padding: a segment of its own
    chunks = (length + pad) // chunk_size

    def chunked(x):
        return x.reshape(rows, value_heads, chunks, chunk_size, *x.shape[3:])

    query, key, value, beta, g = (chunked(x) for x in (query, key, value, beta, g))
    segments = segments.reshape(rows, 1, chunks, chunk_size)
    carried = _previous_last(segments)  # the segment whose state enters each chunk
    same = segments[..., :, None] == segments[..., None, :]
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=query.device).tril()
    decay = g.cumsum(dim=-1)  # from the chunk's start
    pairwise = (decay[..., :, None] - decay[..., None, :]).masked_fill(~(causal & same), float("-inf")).exp()
    k_beta, v_beta = key * beta[..., None], value * beta[..., None]
    # its strictly lower part: block diagonal by segment
    system = (k_beta @ key.transpose(-1, -2)) * pairwise
    new_values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    reads = (segments == carried).float()[..., None]  # the tokens that continue the carried segment
    k_decayed = torch.linalg.solve_triangular(system, k_beta * decay.exp()[..., None], upper=False,
                                              unitriangular=True) * reads
    attention = (query @ key.transpose(-1, -2)) * pairwise
    query_read = query * decay.exp()[..., None] * reads
    last = segments[..., -1:]
    key_write = key * (decay[..., -1:] - decay).exp()[..., None] * (segments == last).float()[..., None]
    # the whole chunk continues it
    keeps = (last == carried).float()[..., None] * decay[..., -1:, None].exp()
    state = query.new_zeros(rows, value_heads, key_dim, value_dim)
    out = torch.zeros_like(value)
    for index in range(chunks):
        corrected = new_values[:, :, index] - k_decayed[:, :, index] @ state
        out[:, :, index] = query_read[:, :, index] @ state + attention[:, :, index] @ corrected
        state = state * keeps[:, :, index] + key_write[:, :, index].transpose(-1, -2) @ corrected
    out = out.reshape(rows, value_heads, -1, value_dim)[:, :, :length]
    return out.transpose(1, 2).to(dtype)


def _previous_last(segments: torch.Tensor) -> torch.Tensor:
    """Each chunk's preceding chunk's last segment, `[..., chunks, 1]` (none before the first:
    -2)."""
    lasts = segments[..., -1:]
    return torch.cat([torch.full_like(lasts[..., :1, :], -2), lasts[..., :-1, :]], dim=-2)


def _conv(hidden_states, weight, bias=None, activation=None, *, segments, **kwargs):
    out = segment_causal_conv1d(hidden_states, weight, bias, segments)
    return (ACT2FN[activation](out) if activation is not None else out).to(hidden_states.dtype)


def _rule(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
          use_qk_l2norm_in_kernel=False, *, segments, **kwargs):
    if initial_state is not None or output_final_state:
        raise ValueError("a packed batch runs without a cache: its segments carry no state out")
    return segment_chunk_gated_delta_rule(query, key, value, g, beta, segments, chunk_size=chunk_size,
                                          use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel), None


def _rule_kernel(kernel, query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
                 use_qk_l2norm_in_kernel=False, *, segments, **kwargs):
    """flash-linear-attention's chunked rule keeps the sequences of one row apart given their
    `cu_seqlens`: the rows laid end to end (each row's padding is a segment of its own, so no sample
    spans two rows)."""
    if initial_state is not None or output_final_state:
        raise ValueError("a packed batch runs without a cache: its segments carry no state out")
    rows, length = segments.shape
    _, counts = torch.unique_consecutive(segments.flatten(), return_counts=True)
    cu_seqlens = F.pad(counts.cumsum(0), (1, 0))
    query, key, value, g, beta = (x.reshape(1, rows * length, *x.shape[2:]) for x in (query, key, value, g, beta))
    out, _ = kernel(query, key, value, g=g, beta=beta, initial_state=None, output_final_state=False,
                    use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens)
    return out.reshape(rows, length, *out.shape[2:]), None


def _conv_kernel(kernel, hidden_states, weight, bias=None, activation=None, *, segments, **kwargs):
    """causal-conv1d keeps a tap within its token's segment given `seq_idx` (int32, channel-last
    input: the layer's transposed projection is)."""
    return kernel(hidden_states, weight, bias, activation=activation, seq_idx=segments.to(torch.int32))


def _rule_probe(generator: torch.Generator, device, dtypes: dict) -> tuple[tuple, dict]:
    """Queries, keys, values (2 heads of 16), slow decays and write strengths of two 128-token rows,
    in the dtypes of the layer's call (fla takes no float32 queries)."""
    shapes = {"query": (2, 128, 2, 16), "key": (2, 128, 2, 16), "value": (2, 128, 2, 16), "g": (2, 128, 2),
              "beta": (2, 128, 2)}
    inputs = {name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}
    inputs["g"], inputs["beta"] = -0.05 * inputs["g"].abs(), inputs["beta"].sigmoid()
    return (tuple(x.to(device, dtypes.get(name, torch.float32)) for name, x in inputs.items()),
            {"use_qk_l2norm_in_kernel": True})


def _conv_probe(generator: torch.Generator, device, dtypes: dict) -> tuple[tuple, dict]:
    """8 channels of two 128-token rows, channel-last as the layer's transposed projection, and a
    4-tap filter, in the dtypes of the layer's call."""
    signal = torch.randn(2, 128, 8, generator=generator).to(device, dtypes.get("hidden_states")).transpose(1, 2)
    weight, bias = (x.to(device, dtypes.get("weight")) for x in (torch.randn(8, 4, generator=generator),
                                                                  torch.randn(8, generator=generator)))
    return (signal, weight, bias), {"activation": "silu"}


@dataclasses.dataclass(frozen=True)
class Mixer:
    torch_path: Callable  # segment-aware, pure torch: any device
    # the kernel transformers routes the layer's call to, given the segments its way
    kernel_path: Callable
    package: str  # the kernel's package (transformers' `use_kernel_func_from_hub_with_fallback`)
    # (generator, device, the call's dtypes) -> the arguments of a call that shows a leak
    probe: Callable


# transformers' names of the functions a linear-attention layer mixes its tokens with
MIXERS = {"torch_chunk_gated_delta_rule": Mixer(_rule, _rule_kernel, "fla", _rule_probe),
          "causal_conv1d_fn": Mixer(_conv, _conv_kernel, "causal_conv1d", _conv_probe)}


@dataclasses.dataclass(frozen=True)
class SegmentAwareMixers:
    """What `apply_segment_aware_mixers` patched: the mixer functions it wrapped (`module.function`),
    and the stateful mixer classes whose module calls none of them."""
    wrapped: tuple[str, ...]
    untouched: tuple[str, ...]

    def describe(self) -> str:
        by_module = {}
        for path in self.wrapped:
            module, name = path.rsplit(".", 1)
            by_module.setdefault(module, []).append(name)
        line = "segment-aware packing: patched " + "; ".join(f"{', '.join(names)} in {module}" for module, names
                                                           in by_module.items())
        line += " (given each token's segment, they keep packed samples apart)"
        if self.untouched:
            line += f"; {', '.join(self.untouched)} call none of them: --packing is checked and refused for them"
        return line


def apply_segment_aware_mixers(model) -> SegmentAwareMixers | None:
    """Wrap, once, each mixer function (`MIXERS`) that the modules of `model`'s stateful mixers
    (`families.stateful_mixer_classes`: linear attention) call: a call given `seq_idx`, each token's
    segment, keeps the segments apart (the kernel where installed and the tensors are on a GPU, else
    the torch path), any other runs as it was. A layer that passes no `seq_idx` on (or mixes with
    other functions) still mixes samples, which `parts.check_packing` finds and refuses. None for a
    model without stateful mixers."""
    classes = set().union(*stateful_mixer_classes(model).values())
    if not classes:
        return None
    wrapped, untouched = [], []
    for cls in sorted(classes, key=lambda cls: cls.__name__):
        module = sys.modules[cls.__module__]
        names = [name for name in MIXERS if callable(getattr(module, name, None))]
        for name in names:
            if not getattr(getattr(module, name), "segment_aware", False):
                setattr(module, name, _dispatching(name, getattr(module, name), MIXERS[name]))
            wrapped.append(f"{module.__name__}.{name}")
        if not names:
            untouched.append(cls.__name__)
    return SegmentAwareMixers(tuple(dict.fromkeys(wrapped)), tuple(untouched))


def check_segment_aware(layer_classes):
    """Raise where a module of `layer_classes` calls a mixer function not made segment-aware: its
    state would run from one packed sample into the next."""
    for cls in layer_classes:
        module = sys.modules[cls.__module__]
        plain = [name for name in MIXERS if callable(getattr(module, name, None))
                 and not getattr(getattr(module, name), "segment_aware", False)]
        if plain:
            raise ValueError(f"a packed batch through {cls.__name__}, whose {' and '.join(plain)} keep no sample "
                             "boundaries: call mmrecipes.vlm.model.segments.apply_segment_aware_mixers(model) "
                             "before the first step (vlm_parts does)")


def kernel_installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def _dispatching(name: str, original, mixer: Mixer):
    torch_function = inspect.unwrap(original)  # transformers' torch path under its kernel routing
    signature, installed = inspect.signature(torch_function), kernel_installed(mixer.package)

    @functools.wraps(original)
    def dispatch(*args, seq_idx=None, **kwargs):
        on_kernel = installed and args[0].device.type in KERNEL_DEVICES
        if seq_idx is None:  # a kernel takes no CPU tensors (check_packing's probe runs on CPU)
            return (torch_function if installed and not on_kernel else original)(*args, **kwargs)
        if on_kernel:
            named = signature.bind_partial(*args, **kwargs).arguments
            dtypes = {key: value.dtype for key, value in named.items() if isinstance(value, torch.Tensor)}
            if _kernel_keeps_segments_apart(name, original, mixer, args[0].device, dtypes):
                return mixer.kernel_path(original, *args, segments=seq_idx, **kwargs)
        return mixer.torch_path(*args, segments=seq_idx, **kwargs)

    dispatch.segment_aware = True
    return dispatch


KERNEL_DEVICES = ("cuda",)
_VERDICTS: dict[tuple, bool] = {}
# The largest difference from the samples kept apart (relative to the largest output) a kernel may show on the probe:
# the torch path in bfloat16 gives 0.002-0.006 there, a leak across the boundaries 0.22 (convolution) and 0.61
# (recurrence).
PROBE_TOLERANCE = 5e-2


def kernel_verdicts() -> dict[str, bool]:
    """{mixer: whether its kernel runs packed batches} of the probes run so far in this process
    (none on CPU)."""
    return {name: used for (name, *_), used in _VERDICTS.items()}


@torch.no_grad()
def _kernel_keeps_segments_apart(name: str, original, mixer: Mixer, device: torch.device, dtypes: dict) -> bool:
    """Whether the kernel, given the segments its way, equals the torch path (in float32) on a small
    probe in the call's dtypes on `device` (three samples of 1, 70 and 57 tokens and a whole row),
    decided once per device and dtypes; where not, the torch path keeps the samples apart and the
    log says why."""
    key = (name, str(device), tuple(sorted((key, str(dtype)) for key, dtype in dtypes.items())))
    if key not in _VERDICTS:
        segments = segment_ids(torch.tensor([1, 70, 57, 128]), (2, 128)).to(device)
        inputs, kwargs = mixer.probe(torch.Generator().manual_seed(0), device, dtypes)
        expected = _first(mixer.torch_path(*(x.float() for x in inputs), segments=segments, **kwargs))
        try:
            got, why = _first(mixer.kernel_path(original, *inputs, segments=segments, **kwargs)), None
            error = ((got.float() - expected).abs().max() / expected.abs().max()).item()
            if not error <= PROBE_TOLERANCE:
                why = f"it differs by {error:.3g} (relative) from the samples kept apart"
        # an install that fails to run is a reason to keep the torch path too
        except Exception as exception:
            why = f"it raised {type(exception).__name__}: {exception}"
        if why:
            logger.warning(f"--packing: {name}'s kernel ({mixer.package}) is not used for packed batches: {why}; "
                           "the torch path keeps the samples apart instead (exact, slower)")
        _VERDICTS[key] = why is None
    return _VERDICTS[key]


def _first(output):
    return output[0] if isinstance(output, tuple) else output
