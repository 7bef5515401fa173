pip install torch==2.13.0 && pip install -e . && python -m raytrain.run --config examples/digits.yaml
pip install torch==2.13.0 && pip install -e ".[dev]" && python -m pytest tests -q
