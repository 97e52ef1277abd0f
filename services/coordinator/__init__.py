"""CoordinatorService: tokenizer, decode loop across the stages, Generate for clients."""
