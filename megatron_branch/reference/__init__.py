"""The truth every mode is judged against: the naive computation, agreement, bias."""
