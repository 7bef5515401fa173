"""What a run records outside its checkpoints: MLflow runs, and the PNG curves of a run or a sweep."""
