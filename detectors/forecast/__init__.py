"""Traffic forecasting: naive baselines, Holt-Winters/ARIMA, an LSTM, rolling-origin backtests and
model selection. Every forecaster sits behind :class:`~detectors.forecast.base.Forecaster`."""
