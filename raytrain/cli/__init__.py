"""The command line's parts beside raytrain.run: the job from the factories, the --search sweep."""
