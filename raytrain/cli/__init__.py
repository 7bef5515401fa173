"""The command line's parts beside raytrain.run: the --search sweep."""
