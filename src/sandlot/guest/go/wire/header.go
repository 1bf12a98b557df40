package wire

import (
	"bytes"
	"encoding/json"
	"math"
	"strconv"
)

// The getters below read a header's fields the way the Python agent did (`h.get(key)`): a
// missing field and a JSON null are the same; a field of the wrong type is reported, never a
// crash (the host sends what protocol.py says, but the agent must survive anything).

// Raw is the field's JSON, and whether it is present and not null.
func (h Header) Raw(key string) (json.RawMessage, bool) {
	raw, ok := h[key]
	if !ok || string(raw) == "null" {
		return nil, false
	}
	return raw, true
}

// ID is the request id: a JSON integer, or not a request.
func (h Header) ID() (int64, bool) {
	raw, ok := h.Raw("id")
	if !ok {
		return 0, false
	}
	id, err := strconv.ParseInt(string(raw), 10, 64)
	return id, err == nil
}

// Str is a string field (ok false when absent or not a string).
func (h Header) Str(key string) (string, bool) {
	raw, ok := h.Raw(key)
	if !ok || raw[0] != '"' {
		return "", false
	}
	if s, ok := plainString(raw); ok {
		return s, true
	}
	var s string
	if json.Unmarshal(raw, &s) != nil {
		return "", false
	}
	return s, true
}

// Float is a number field: present (not null), and err when it is not a number.
func (h Header) Float(key string) (v float64, present bool, err error) {
	raw, ok := h.Raw(key)
	if !ok {
		return 0, false, nil
	}
	if raw[0] == '"' { // int("5") and float("5") work in the Python agent too
		var s string
		if err := json.Unmarshal(raw, &s); err != nil {
			return 0, true, err
		}
		raw = json.RawMessage(s)
	}
	switch string(raw) {
	case "true":
		return 1, true, nil
	case "false":
		return 0, true, nil
	}
	v, err = strconv.ParseFloat(string(bytes.TrimSpace(raw)), 64)
	return v, true, err
}

// Int is an integer field (a float is truncated, as int() does).
func (h Header) Int(key string) (v int64, present bool, err error) {
	raw, ok := h.Raw(key)
	if ok {
		if i, err := strconv.ParseInt(string(raw), 10, 64); err == nil {
			return i, true, nil
		}
	}
	f, present, err := h.Float(key)
	if err != nil || math.IsNaN(f) || math.IsInf(f, 0) {
		if err == nil {
			err = strconv.ErrRange
		}
		return 0, present, err
	}
	return int64(f), present, nil
}

// Truthy is Python's truthiness of the field: absent, null, false, 0, "", [] and {} are false.
func (h Header) Truthy(key string) bool {
	raw, ok := h.Raw(key)
	if !ok {
		return false
	}
	switch string(bytes.TrimSpace(raw)) {
	case "false", "0", `""`, "[]", "{}", "0.0", "-0", "-0.0":
		return false
	}
	if raw[0] == '[' || raw[0] == '{' { // an empty one with whitespace inside
		var v []any
		if json.Unmarshal(raw, &v) == nil && len(v) == 0 {
			return false
		}
		var m map[string]any
		if json.Unmarshal(raw, &m) == nil && len(m) == 0 {
			return false
		}
	}
	if f, err := strconv.ParseFloat(string(raw), 64); err == nil && f == 0 {
		return false
	}
	return true
}

// PyStr is Python's str() of the field's value: strings as they are, true as "True", null as
// "None", numbers as written.
func PyStr(raw json.RawMessage) string {
	if len(raw) == 0 {
		return "None"
	}
	switch string(raw) {
	case "null":
		return "None"
	case "true":
		return "True"
	case "false":
		return "False"
	}
	if raw[0] == '"' {
		var s string
		if json.Unmarshal(raw, &s) == nil {
			return s
		}
	}
	return string(raw)
}

// PyRepr is Python's repr() of a string field ('x'), else as PyStr.
func PyRepr(raw json.RawMessage) string {
	if len(raw) > 0 && raw[0] == '"' {
		return "'" + PyStr(raw) + "'"
	}
	return PyStr(raw)
}

// Has is whether the field is there at all (null included), as `key in h`.
func (h Header) Has(key string) bool {
	_, ok := h[key]
	return ok
}
