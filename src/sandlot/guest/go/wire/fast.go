package wire

import (
	"encoding/json"
	"sort"
	"strconv"
	"unicode/utf8"
)

// Why a second JSON path: in a VM restored under TCG (no KVM) every page of guest code is
// translated afresh by the new QEMU, and encoding/json's reflection touches a lot of code: the
// first hello and configure of a restored agent spent tens of ms decoding and encoding their
// frames. The headers the agent reads and writes are flat objects of strings, numbers, bools
// and small maps and lists; these functions handle exactly those, byte for byte as
// encoding/json would, and say so (ok false) for anything else, which then goes through
// encoding/json as before.

const maxFastDepth = 32

// splitObject decodes a frame header as json.Unmarshal into a Header would: a JSON object
// whose values are kept raw. ok is false when it does not handle the input (not an object,
// invalid JSON, escaped or non-UTF-8 keys, deep nesting): decode it with encoding/json then.
func splitObject(data []byte) (h Header, ok bool) {
	data = append([]byte(nil), data...) // the values point into this copy
	i := skipSpace(data, 0)
	if i >= len(data) || data[i] != '{' {
		return nil, false
	}
	h = Header{}
	i = skipSpace(data, i+1)
	if i < len(data) && data[i] == '}' {
		return h, skipSpace(data, i+1) == len(data)
	}
	for {
		if i >= len(data) || data[i] != '"' {
			return nil, false
		}
		end, plain := scanString(data, i)
		if end < 0 || !plain || !utf8.Valid(data[i+1:end-1]) {
			return nil, false
		}
		key := string(data[i+1 : end-1])
		i = skipSpace(data, end)
		if i >= len(data) || data[i] != ':' {
			return nil, false
		}
		i = skipSpace(data, i+1)
		vend := scanValue(data, i, 0)
		if vend < 0 {
			return nil, false
		}
		h[key] = json.RawMessage(data[i:vend:vend])
		i = skipSpace(data, vend)
		if i >= len(data) {
			return nil, false
		}
		if data[i] == '}' {
			return h, skipSpace(data, i+1) == len(data)
		}
		if data[i] != ',' {
			return nil, false
		}
		i = skipSpace(data, i+1)
	}
}

func skipSpace(data []byte, i int) int {
	for i < len(data) {
		switch data[i] {
		case ' ', '\t', '\n', '\r':
			i++
		default:
			return i
		}
	}
	return i
}

// scanString: the end (just past the closing quote) of the JSON string at data[i], or -1;
// plain is whether it has no escapes.
func scanString(data []byte, i int) (end int, plain bool) {
	plain = true
	for i++; i < len(data); i++ {
		switch c := data[i]; {
		case c == '"':
			return i + 1, plain
		case c < 0x20:
			return -1, false
		case c == '\\':
			plain = false
			i++
			if i >= len(data) {
				return -1, false
			}
			switch data[i] {
			case '"', '\\', '/', 'b', 'f', 'n', 'r', 't':
			case 'u':
				if i+4 >= len(data) {
					return -1, false
				}
				for _, x := range data[i+1 : i+5] {
					if !isHex(x) {
						return -1, false
					}
				}
				i += 4
			default:
				return -1, false
			}
		}
	}
	return -1, false
}

func isHex(c byte) bool {
	return '0' <= c && c <= '9' || 'a' <= c && c <= 'f' || 'A' <= c && c <= 'F'
}

func isDigit(c byte) bool { return '0' <= c && c <= '9' }

// scanValue: the end of the JSON value at data[i], or -1 if it is not one.
func scanValue(data []byte, i, depth int) int {
	if i >= len(data) || depth > maxFastDepth {
		return -1
	}
	switch c := data[i]; {
	case c == '"':
		end, _ := scanString(data, i)
		return end
	case c == '{' || c == '[':
		closer := byte('}')
		if c == '[' {
			closer = ']'
		}
		i = skipSpace(data, i+1)
		if i < len(data) && data[i] == closer {
			return i + 1
		}
		for {
			if c == '{' {
				if i >= len(data) || data[i] != '"' {
					return -1
				}
				if i, _ = scanString(data, i); i < 0 {
					return -1
				}
				if i = skipSpace(data, i); i >= len(data) || data[i] != ':' {
					return -1
				}
				i = skipSpace(data, i+1)
			}
			if i = scanValue(data, i, depth+1); i < 0 {
				return -1
			}
			if i = skipSpace(data, i); i >= len(data) {
				return -1
			}
			if data[i] == closer {
				return i + 1
			}
			if data[i] != ',' {
				return -1
			}
			i = skipSpace(data, i+1)
		}
	case c == '-' || isDigit(c):
		return scanNumber(data, i)
	}
	for _, lit := range [...]string{"true", "false", "null"} {
		if len(data)-i >= len(lit) && string(data[i:i+len(lit)]) == lit {
			return i + len(lit)
		}
	}
	return -1
}

func scanNumber(data []byte, i int) int {
	if data[i] == '-' {
		i++
	}
	switch {
	case i < len(data) && data[i] == '0':
		i++
	case i < len(data) && isDigit(data[i]):
		for i < len(data) && isDigit(data[i]) {
			i++
		}
	default:
		return -1
	}
	if i < len(data) && data[i] == '.' {
		i++
		if i >= len(data) || !isDigit(data[i]) {
			return -1
		}
		for i < len(data) && isDigit(data[i]) {
			i++
		}
	}
	if i < len(data) && (data[i] == 'e' || data[i] == 'E') {
		i++
		if i < len(data) && (data[i] == '+' || data[i] == '-') {
			i++
		}
		if i >= len(data) || !isDigit(data[i]) {
			return -1
		}
		for i < len(data) && isDigit(data[i]) {
			i++
		}
	}
	return i
}

// plainString is the value of a JSON string token without escapes, control characters or
// invalid UTF-8 (what json.Unmarshal would give), or ok false.
func plainString(raw []byte) (string, bool) {
	if len(raw) < 2 || raw[0] != '"' || raw[len(raw)-1] != '"' {
		return "", false
	}
	body := raw[1 : len(raw)-1]
	for _, c := range body {
		if c < 0x20 || c == '"' || c == '\\' {
			return "", false
		}
	}
	if !utf8.Valid(body) {
		return "", false
	}
	return string(body), true
}

// appendJSON appends v as encoding/json (SetEscapeHTML(false)) would, for the types the
// agent's headers use; ok false for any other (the caller then uses encoding/json).
func appendJSON(b []byte, v any, depth int) ([]byte, bool) {
	if depth > maxFastDepth {
		return b, false
	}
	switch v := v.(type) {
	case nil:
		return append(b, "null"...), true
	case bool:
		return strconv.AppendBool(b, v), true
	case string:
		return appendString(b, v), true
	case int:
		return strconv.AppendInt(b, int64(v), 10), true
	case int64:
		return strconv.AppendInt(b, v, 10), true
	case json.RawMessage:
		// Marshal compacts a RawMessage; a single string token is already compact.
		if _, ok := plainString(v); ok {
			return append(b, v...), true
		}
		return b, false
	case []string:
		if v == nil {
			return append(b, "null"...), true
		}
		b = append(b, '[')
		for i, s := range v {
			if i > 0 {
				b = append(b, ',')
			}
			b = appendString(b, s)
		}
		return append(b, ']'), true
	case []any:
		if v == nil {
			return append(b, "null"...), true
		}
		b = append(b, '[')
		for i, x := range v {
			if i > 0 {
				b = append(b, ',')
			}
			var ok bool
			if b, ok = appendJSON(b, x, depth+1); !ok {
				return b, false
			}
		}
		return append(b, ']'), true
	case map[string]any:
		if v == nil {
			return append(b, "null"...), true
		}
		keys := make([]string, 0, len(v))
		for k := range v {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		b = append(b, '{')
		for i, k := range keys {
			if i > 0 {
				b = append(b, ',')
			}
			b = append(appendString(b, k), ':')
			var ok bool
			if b, ok = appendJSON(b, v[k], depth+1); !ok {
				return b, false
			}
		}
		return append(b, '}'), true
	}
	return b, false
}

const hexDigits = "0123456789abcdef"

// appendString is encoding/json's string encoding without HTML escaping: quotes, backslashes
// and control characters escaped, invalid UTF-8 as U+FFFD, U+2028 and U+2029 escaped.
func appendString(b []byte, s string) []byte {
	b = append(b, '"')
	start := 0
	for i := 0; i < len(s); {
		if c := s[i]; c < utf8.RuneSelf {
			if c >= 0x20 && c != '"' && c != '\\' {
				i++
				continue
			}
			b = append(b, s[start:i]...)
			switch c {
			case '\\', '"':
				b = append(b, '\\', c)
			case '\n':
				b = append(b, '\\', 'n')
			case '\r':
				b = append(b, '\\', 'r')
			case '\t':
				b = append(b, '\\', 't')
			default:
				b = append(b, '\\', 'u', '0', '0', hexDigits[c>>4], hexDigits[c&0xF])
			}
			i++
			start = i
			continue
		}
		r, size := utf8.DecodeRuneInString(s[i:])
		if r == utf8.RuneError && size == 1 {
			b = append(b, s[start:i]...)
			b = append(b, `\ufffd`...)
			i += size
			start = i
			continue
		}
		if r == '\u2028' || r == '\u2029' {
			b = append(b, s[start:i]...)
			b = append(b, '\\', 'u', '2', '0', '2', hexDigits[r&0xF])
			i += size
			start = i
			continue
		}
		i += size
	}
	b = append(b, s[start:]...)
	return append(b, '"')
}
