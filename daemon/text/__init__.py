"""Text in and out of the model: tokenizers (Hugging Face and GGUF vocabularies), chat
templates and the budget their rendering runs under."""
