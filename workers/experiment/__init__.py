"""`sprawl experiment`: experiments that answer a question with real runs of the pipeline."""
