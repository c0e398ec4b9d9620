"""Zero-shot classification during contrastive training, as open_clip users watch ImageNet top-1
(CLAP's: ESC-50 clips against "This is a sound of {}.").

Each class is embedded as the mean of its prompts' normalised text embeddings (one prompt per
template, "a photo of a {}." ...), renormalised; each image (or clip) is classified by its scores
against them. SigLIP's sigmoid of the same scaled score (plus its bias) orders the classes identically,
so top-k is the same as with its sigmoid scores. The class embeddings are computed once per
evaluation. Every rank embeds every class (the same forward on every rank, as FSDP2 and ZeRO-3
need) and its own share of the images; correct counts are summed over ranks, so every rank logs
the same `zeroshot_top1` / `zeroshot_top5`.
"""


import datasets
import torch

from ..distributed import batches_in_step, sum_over_ranks
from ..images import image_inputs, to_device
from ..paths import resolve_name
from ..sources import split_by_data_rank
from .arguments import AUDIO_TEMPLATES, DEFAULT_TEMPLATES, ZeroShotArgs
from .audio_pairs import clip_features, decoded_clip, is_audio_extractor, stacked_clips


class ZeroShotSet:
    """This data rank's share of the zero-shot images (preprocessed), the class names and
    prompts."""

    def __init__(self, args: ZeroShotArgs, tokenizer, image_processor, *, caption_length: int, pad_to_max_length: bool,
                 data_rank: int, data_world: int, audio_max_seconds: float = 600.0):
        files = {"test": args.zeroshot_data_files} if args.zeroshot_data_files else None
        loaded = datasets.load_dataset(resolve_name(args.zeroshot_dataset), data_files=files)
        only = next(iter(loaded)) if len(loaded) == 1 else None
        split = args.zeroshot_split or ("test" if "test" in loaded else only)
        if split not in loaded:
            raise ValueError(f"--zeroshot_dataset {args.zeroshot_dataset} has splits {sorted(loaded)}: name one with "
                             "--zeroshot_split")
        rows = loaded[split]
        self.audio = is_audio_extractor(image_processor)
        self.column = args.zeroshot_audio_column if self.audio else args.zeroshot_image_column
        if isinstance(rows.features.get(self.column), datasets.Audio):  # decoded by us (PyAV), as training clips
            rows = rows.cast_column(self.column, datasets.Audio(decode=False))
        for column in (self.column, args.zeroshot_label_column):
            if column not in rows.column_names:
                raise ValueError(f"--zeroshot_dataset {args.zeroshot_dataset}: no column {column!r} (it has "
                                 f"{rows.column_names}); set --zeroshot_{'audio' if self.audio else 'image'}_column / "
                                 "--zeroshot_label_column")
        label_feature = rows.features[args.zeroshot_label_column]
        if args.zeroshot_class_names:
            self.class_names = [name.strip() for name in args.zeroshot_class_names.split(",")]
        elif isinstance(label_feature, datasets.ClassLabel):
            self.class_names = label_feature.names
        else:
            raise ValueError(f"--zeroshot_dataset {args.zeroshot_dataset}: the label column "
                             f"{args.zeroshot_label_column!r} is not a ClassLabel: give the names with "
                             "--zeroshot_class_names")
        given = args.zeroshot_templates or (AUDIO_TEMPLATES if self.audio else DEFAULT_TEMPLATES)
        templates = [template for template in given.split("|") if template.strip()]
        if not templates or any("{}" not in template for template in templates):
            raise ValueError(f"--zeroshot_templates {given!r}: each template needs one {{}} for the class")
        self.args, self.image_processor, self.audio_max_seconds = args, image_processor, audio_max_seconds
        self.filler = self.inputs([rows[0]])
        self.rows = split_by_data_rank(rows.to_iterable_dataset(num_shards=data_world), args.zeroshot_dataset,
                                       data_rank, data_world)
        prompts = [template.format(name) for name in self.class_names for template in templates]
        encoded = tokenizer(prompts, padding="max_length" if pad_to_max_length else True, truncation=True,
                            max_length=caption_length, return_tensors="pt")
        # As the training collator: an attention mask always (ones where the tokenizer gives none).
        self.prompts = {"input_ids": encoded["input_ids"],
                        "attention_mask": encoded.get("attention_mask", torch.ones_like(encoded["input_ids"]))}
        self.templates = len(templates)

    def batches(self):
        """(image inputs, labels) of this rank's images, preprocessed as the training images are."""
        batch = []
        for row in self.rows:
            batch.append(row)
            if len(batch) == self.args.per_device_zeroshot_batch_size:
                yield self._collate(batch)
                batch = []
        if batch:
            yield self._collate(batch)

    def _collate(self, rows):
        return self.inputs(rows), torch.tensor([row[self.args.zeroshot_label_column] for row in rows])

    def inputs(self, rows) -> dict:
        """The model's media inputs for `rows`: images as the eval transform gives them, clips as
        `audio_pairs` makes them, a longer clip's crop drawn from its own length (the same on any
        number of ranks). A clip that cannot be used stops the run: a zero-shot set is curated, and
        leaving one out would change what its score means."""
        if not self.audio:
            return image_inputs(self.image_processor, [row[self.column].convert("RGB") for row in rows])
        clips = []
        for row in rows:
            samples, problem = decoded_clip(row[self.column], self.image_processor, self.audio_max_seconds)
            if problem is not None:
                raise ValueError(f"--zeroshot_dataset {self.args.zeroshot_dataset}: a clip of class "
                                 f"{self.class_names[row[self.args.zeroshot_label_column]]!r} is {problem}: leave it "
                                 "out of the set, or fix it")
            clips.append(clip_features(self.image_processor, samples, len(samples)))
        return stacked_clips(clips, self.image_processor)


@torch.no_grad()
def evaluate_zeroshot(model, zeroshot: ZeroShotSet, device) -> dict:
    """{zeroshot_top1, zeroshot_top5, zeroshot_images}: the same numbers on every rank.

    The model's forward takes an image (or clip) batch and a text batch of any sizes and returns their
    normalised embeddings first: the class prompts go with one image, each image batch with one
    prompt. A rank with fewer image batches forwards the filler image until every rank is done
    (discarded: `batches_in_step`).
    """
    model.eval()
    prompts = to_device(zeroshot.prompts, device)
    class_embeds = model(**to_device(zeroshot.filler, device), **prompts)[1].float()
    class_embeds = class_embeds.reshape(len(zeroshot.class_names), zeroshot.templates, -1).mean(dim=1)
    class_embeds = torch.nn.functional.normalize(class_embeds, dim=-1)
    one_prompt = {key: value[:1] for key, value in prompts.items()}
    top_k = min(5, len(zeroshot.class_names))
    totals = torch.zeros(3, device=device)  # top-1 right, top-5 right, images
    for (images, labels), real in batches_in_step(zeroshot.batches(), (zeroshot.filler, None), device):
        image_embeds = model(**to_device(images, device), **one_prompt)[0].float()
        if real:
            ranked = (image_embeds @ class_embeds.T).topk(top_k, dim=1).indices
            labels = labels.to(device)
            totals += torch.stack([(ranked[:, 0] == labels).sum(), (ranked == labels[:, None]).any(dim=1).sum(),
                                   torch.tensor(len(labels), device=device)]).float()
    model.train()
    top1, top5, images = sum_over_ranks(totals).tolist()
    if not images:
        return {}
    return {"zeroshot_top1": top1 / images, "zeroshot_top5": top5 / images, "zeroshot_images": int(images)}
