python -m raytrain.run --config examples/digits.yaml --set report_to=mlflow
mlflow ui --backend-store-uri sqlite:///$PWD/mlflow.db
