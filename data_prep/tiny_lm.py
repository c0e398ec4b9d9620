"""The tiny base language model the embedded "build your own VLM" pipeline composes with a vision tower.

    python data_prep/tiny_lm.py                      # writes data/tiny_lm (about a minute on 2 CPU cores)

A Llama-architecture causal LM at the size of the default tiny Llava's language model (width 128, 2 layers), with
tied input and output embeddings (as SmolLM2 has), on the embedded chat tokenizer (data/vlm_tokenizer: its chat
template, `<image>` and pad tokens). It is pretrained briefly, as a base model is, on plain text: the questions
and answers of the embedded conversations (image and text-only, training splits) and the embedded captions, so it
knows the shapes' words before it sees an image (300 steps of 32 x 64 tokens; loss 0.67 at the end). Seeded data
order and initialisation.
"""

import argparse
from pathlib import Path

import datasets
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data"


def pretraining_texts() -> list[str]:
    """One text per row: a conversation's turns joined by spaces (no chat template), or a caption."""
    texts = []
    for name in ("image_chat", "text_chat"):
        for row in datasets.load_dataset(str(DATA / "vlm_shapes" / name), split="train").select_columns("messages"):
            texts.append(" ".join(part["text"] for message in row["messages"] for part in message["content"]
                                  if part["type"] == "text" and part["text"]))
    captions = datasets.load_dataset(str(DATA / "shapes"), split="train").select_columns("text")["text"]
    return texts + [caption for caption in captions if caption and caption.strip()]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", default=str(DATA / "tiny_lm"))
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    tokenizer = AutoTokenizer.from_pretrained(DATA / "vlm_tokenizer")
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=tokenizer.model_max_length,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                         tie_word_embeddings=True)
    model = LlamaForCausalLM(config)
    texts = pretraining_texts()
    ids = [tokenizer(text + tokenizer.eos_token, add_special_tokens=False)["input_ids"] for text in texts]
    stream = torch.tensor([token for row in ids for token in row])
    length, batch = 64, 32
    blocks = stream[:len(stream) // length * length].view(-1, length)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    order = torch.randperm(len(blocks), generator=torch.Generator().manual_seed(0))
    model.train()
    for step in range(args.steps):
        chosen = order[(step * batch) % len(blocks):][:batch]
        loss = model(input_ids=blocks[chosen], labels=blocks[chosen]).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % 50 == 0 or step == args.steps - 1:
            print(f"step {step + 1}/{args.steps} | loss {loss.item():.4f}")
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(args.output_dir)
    tokenizer.save_pretrained(args.output_dir)
    print(f"saved {sum(p.numel() for p in model.parameters()):,} parameters, {len(blocks)} blocks of {length} tokens "
          f"from {len(texts)} texts, to {args.output_dir}")


if __name__ == "__main__":
    main()
