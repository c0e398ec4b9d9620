"""The tiny tokenizer and CLIP: EOS pooling (without an EOS every caption pools its first token) and any-text
coverage."""

import torch

from mmrecipes.contrastive.arguments import ModelArgs
from mmrecipes.contrastive.models import build_contrastive


def test_every_caption_ends_in_eos_even_truncated_and_arbitrary_text():
    _, tokenizer, _ = build_contrastive(ModelArgs())
    captions = ["a small red circle", "Ünïcode 漢字 and emoji 🙂 text", "word " * 100]
    encoded = tokenizer(captions, truncation=True, max_length=16)["input_ids"]
    for ids in encoded:
        assert ids.count(tokenizer.eos_token_id) == 1 and ids[-1] == tokenizer.eos_token_id
        assert tokenizer.unk_token_id is None or tokenizer.unk_token_id not in ids  # byte-level: nothing unknown
    round_trip = tokenizer.decode(tokenizer(captions[1])["input_ids"], skip_special_tokens=True)
    assert round_trip.strip() == captions[1]


def test_text_tower_pools_at_eos_so_captions_embed_differently():
    torch.manual_seed(0)
    model, tokenizer, _ = build_contrastive(ModelArgs())
    batch = tokenizer(["a small red circle", "a large blue square above a small green star"], padding=True,
                      return_tensors="pt")
    with torch.no_grad():
        out = model.text_model(**batch)
    eos_position = (batch["input_ids"] == tokenizer.eos_token_id).int().argmax(-1)
    torch.testing.assert_close(out.pooler_output, out.last_hidden_state[torch.arange(2), eos_position])
    assert eos_position.tolist() == (batch["attention_mask"].sum(-1) - 1).tolist()  # the last real token
    assert not torch.allclose(out.pooler_output[0], out.pooler_output[1], atol=1e-3)
