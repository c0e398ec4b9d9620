"""Train the tiny tokenizers of the default tiny models on the embedded captions.

    python data_prep/make_tokenizer.py            # writes data/tokenizer/ (CLIP, SigLIP)
    python data_prep/make_tokenizer.py --siglip2  # writes data/siglip2_tokenizer/ (SigLIP 2)

Byte-level, so it encodes any text a user points the default model at. The post-processor
wraps every caption as `<|startoftext|> ... <|endoftext|>`: HF CLIP pools the text tower at
the first `eos_token_id`, and without an EOS every caption would pool its first token and all
texts would embed the same. The EOS id is 0, not 2, because CLIP treats
`eos_token_id == 2` as the legacy "pool at the largest token id" rule.

SigLIP 2 loads the tokenizer of its own class (`Siglip2Tokenizer`: Gemma's pipeline, lowercased, padded on the
left, no special tokens added) whatever a saved directory names, so its tiny model gets one of that class,
trained on the same captions.
"""

import argparse
import string
from pathlib import Path

import datasets
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast, Siglip2Tokenizer

EOS, BOS, PAD = "<|endoftext|>", "<|startoftext|>", "<|pad|>"
ROOT = Path(__file__).resolve().parents[1]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--captions", default=str(ROOT / "data" / "shapes" / "train-*.parquet"))
    parser.add_argument("--siglip2", action="store_true", help="the SigLIP 2 tokenizer (vocab 256, 64 tokens)")
    parser.add_argument("--output_dir", default=None, help="default data/tokenizer or data/siglip2_tokenizer")
    parser.add_argument("--vocab_size", type=int, default=512)
    parser.add_argument("--model_max_length", type=int, default=32)
    args = parser.parse_args()

    captions = datasets.load_dataset("parquet", data_files=args.captions, split="train")["text"]
    if args.siglip2:
        output_dir = args.output_dir or str(ROOT / "data" / "siglip2_tokenizer")
        siglip2 = Siglip2Tokenizer(model_max_length=64).train_new_from_iterator(
            (c for c in captions if c and c.strip()), vocab_size=256, initial_alphabet=list(string.printable.lower()))
        siglip2.save_pretrained(output_dir)
        print(f"wrote {output_dir}: vocab {len(siglip2)}, pad={siglip2.pad_token_id}")
        return
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
    output_dir = args.output_dir or str(ROOT / "data" / "tokenizer")
    fast.save_pretrained(output_dir)
    print(f"wrote {output_dir}: vocab {fast.vocab_size}, eos={fast.eos_token_id} bos={fast.bos_token_id} "
          f"pad={fast.pad_token_id}")


if __name__ == "__main__":
    main()
