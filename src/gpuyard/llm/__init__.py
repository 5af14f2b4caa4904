"""Language models: the registry record of a causal LM (with its tokenizer and context length),
perplexity evaluation and promotion gated on it, and the planner's view of a Hugging Face config."""
