"""The rows a VLM recipe trains on: chat and prompt rows in any layout, their answer-token labels
from the chat template, videos, the collator (padding, packing, the dummy image)."""
