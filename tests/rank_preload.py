"""Imported once by the fork server that the tests fork their ranks from (gloo.start_rank_server): what every
rank of a recipe would otherwise import and build on its own, about 2 s per rank on 2 cores."""

from io import BytesIO

import deepspeed  # noqa: F401  accelerate imports it to unwrap any model
import deepspeed.ops
import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401  ZeRO's optimizer check: torch.compile, inductor
import deepspeed.runtime.zero.stage3  # noqa: F401
import peft  # noqa: F401
import transformers.optimization  # noqa: F401  the recipes' schedulers
from transformers.conversion_mapping import get_checkpoint_conversion_mapping
from transformers.models.clip import modeling_clip  # noqa: F401  the tiny models' modeling code
from transformers.models.llama import modeling_llama  # noqa: F401
from transformers.models.llava import modeling_llava  # noqa: F401
from transformers.models.siglip import modeling_siglip  # noqa: F401

from mmrecipes.model_card import History, plot_curves

# A CPU rank's DeepSpeed backend builds its shared-memory all-reduce op (C++: 35-50 s of g++ on a fresh machine)
# for DeepSpeed-inference's tensor-parallel all-reduce, which training never calls: unavailable in the tests' ranks.
deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
get_checkpoint_conversion_mapping("clip")  # the weight-renaming table (1000 regexes) every save and load reads
history = History()
history.add(1, {"loss": 1.0})
plot_curves(history, BytesIO(), ["loss"])  # matplotlib's imports, fonts and text layout
