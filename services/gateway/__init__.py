"""The OpenAI-compatible HTTP gateway: a thin client of CoordinatorService.Generate."""
