"""Train the tiny byte-level BPE tokenizer that the default tiny CLIP uses.

    python data_prep/make_tokenizer.py         # writes data/tokenizer/

Byte-level, so it encodes any text a user points the default model at. The post-processor
wraps every caption as `<|startoftext|> ... <|endoftext|>`: HF CLIP pools the text tower at
the first `eos_token_id`, and without an EOS every caption would pool its first token and all
texts would embed the same. The EOS id is 0, not 2, because CLIP treats
`eos_token_id == 2` as the legacy "pool at the largest token id" rule.
"""

import argparse
from pathlib import Path

import datasets
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

EOS, BOS, PAD = "<|endoftext|>", "<|startoftext|>", "<|pad|>"
ROOT = Path(__file__).resolve().parents[1]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--captions", default=str(ROOT / "data" / "shapes" / "train-*.parquet"))
    parser.add_argument("--output_dir", default=str(ROOT / "data" / "tokenizer"))
    parser.add_argument("--vocab_size", type=int, default=512)
    parser.add_argument("--model_max_length", type=int, default=32)
    args = parser.parse_args()

    captions = datasets.load_dataset("parquet", data_files=args.captions, split="train")["text"]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=args.vocab_size,
        special_tokens=[EOS, BOS, PAD],  # ids 0, 1, 2
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator((c for c in captions if c and c.strip()), trainer=trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A {EOS}", special_tokens=[(BOS, tokenizer.token_to_id(BOS)), (EOS, tokenizer.token_to_id(EOS))]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=BOS, eos_token=EOS, pad_token=PAD, model_max_length=args.model_max_length
    )
    fast.save_pretrained(args.output_dir)
    print(f"wrote {args.output_dir}: vocab {fast.vocab_size}, eos={fast.eos_token_id} bos={fast.bos_token_id} "
          f"pad={fast.pad_token_id}")


if __name__ == "__main__":
    main()
