package telemetry

import (
	"strings"

	"go.opentelemetry.io/otel/propagation"
)

// HeaderCarrier adapts NATS message headers (nats.Header converts to it)
// to a propagation.TextMapCarrier. Unlike propagation.HeaderCarrier over the
// same map, Get matches names without regard to case, so a lowercase
// "traceparent" written by another client is read. Set writes the
// lowercase W3C names.
type HeaderCarrier map[string][]string

var _ propagation.TextMapCarrier = HeaderCarrier(nil)

// Get returns the first value of key, matching names case-insensitively.
func (c HeaderCarrier) Get(key string) string {
	if vs, ok := c[key]; ok && len(vs) > 0 {
		return vs[0]
	}
	for k, vs := range c {
		if len(k) == len(key) && len(vs) > 0 && strings.EqualFold(k, key) {
			return vs[0]
		}
	}
	return ""
}

// Set replaces key's values, dropping any spelling of it in another case.
func (c HeaderCarrier) Set(key, value string) {
	for k := range c {
		if len(k) == len(key) && k != key && strings.EqualFold(k, key) {
			delete(c, k)
		}
	}
	c[key] = []string{value}
}

// Keys lists the header names.
func (c HeaderCarrier) Keys() []string {
	keys := make([]string, 0, len(c))
	for k := range c {
		keys = append(keys, k)
	}
	return keys
}

// MetadataCarrier adapts Watermill-style metadata (map[string]string) to a
// propagation.TextMapCarrier whose Get, like HeaderCarrier's, matches
// names without regard to case.
type MetadataCarrier map[string]string

var _ propagation.TextMapCarrier = MetadataCarrier(nil)

// Get returns key's value, matching names case-insensitively.
func (c MetadataCarrier) Get(key string) string {
	if v, ok := c[key]; ok {
		return v
	}
	for k, v := range c {
		if strings.EqualFold(k, key) {
			return v
		}
	}
	return ""
}

// Set replaces key's value, dropping any spelling of it in another case.
func (c MetadataCarrier) Set(key, value string) {
	for k := range c {
		if k != key && strings.EqualFold(k, key) {
			delete(c, k)
		}
	}
	c[key] = value
}

// Keys lists the metadata names.
func (c MetadataCarrier) Keys() []string {
	keys := make([]string, 0, len(c))
	for k := range c {
		keys = append(keys, k)
	}
	return keys
}
