python -m raytrain.run --config examples/digits.yaml --search search_spaces/digits.yaml --set num_train_epochs=4
