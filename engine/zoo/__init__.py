"""The zoo: corpus, tokenizer, tiny-model and head training (python -m engine.zoo)."""
