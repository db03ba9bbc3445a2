"""Intake: records polled from Kafka, validated and tokenized into accepted jobs or rejections."""
