"""The small package behind the DeepSpeed tutorial notebooks: notebooks tell the story, helpers do the work."""
