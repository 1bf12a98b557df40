package wire

import (
	"bytes"
	"encoding/json"
	"math/rand"
	"reflect"
	"testing"
)

// The fast paths must agree with encoding/json wherever they answer.

func TestSplitObjectAgreesWithUnmarshal(t *testing.T) {
	inputs := []string{
		`{}`, ` { } `, `{"id":1,"op":"hello","nonce":"ab12","proto":1}`,
		`{"a":null,"b":true,"c":false,"d":-0.5e+3,"e":[1,[2,{}],"x"],"f":{"g":{"h":[]}}}`,
		`{"s":"a\"b\\c\/d\b\f\n\r\t\u00e9\ud83d\ude00"}`, `{"dup":1,"dup":2}`,
		"{\"k\":\"\xff\xfe invalid utf-8\"}", `{"esc\u0061ped key":1}`, "{\"\xff\":1}",
		`{"n":0}`, `{"n":01}`, `{"n":-}`, `{"n":1.}`, `{"n":1e}`, `{"n":.5}`, `{"t":tru}`,
		`{"a":1,}`, `{"a" 1}`, `{"a":1`, `{"a":1}}`, `{"a":1} x`, `[1]`, `null`, `"s"`, ``,
		`{"a":"unterminated}`, "{\"a\":\"ctl\x01\"}", `{"a":"\x"}`, `{"a":"\u12g4"}`,
		`{"env":{"A":"1","B":"two words"},"cmd":"echo hi","window":32,"timeout":null}`,
		`{"deep":[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]}`,
	}
	for _, in := range inputs {
		var want Header
		wantErr := json.Unmarshal([]byte(in), &want)
		got, ok := splitObject([]byte(in))
		if !ok {
			continue // encoding/json decides
		}
		if wantErr != nil || want == nil {
			t.Errorf("%q: fast path took input encoding/json rejects (%v)", in, wantErr)
			continue
		}
		if !reflect.DeepEqual(got, want) {
			t.Errorf("%q: fast %v, encoding/json %v", in, got, want)
		}
	}
}

func TestSplitObjectTakesHeaders(t *testing.T) {
	for _, in := range []string{`{}`, `{"id":1,"op":"hello","nonce":"ab12","proto":1}`,
		`{"env":{"A":"1"},"cmd":"echo \"hi\"\n","window":32,"timeout":null,"x":[1.5e3]}`,
		"{\"k\":\"\xff\"}"} {
		if _, ok := splitObject([]byte(in)); !ok {
			t.Errorf("%q: not taken by the fast path", in)
		}
	}
}

func TestPlainStringAgreesWithUnmarshal(t *testing.T) {
	for _, in := range []string{`"abc"`, `""`, `"a\"b"`, `"\u00e9"`, "\"\xff\"", `"é ok"`,
		"\"tab\there\""} {
		var want string
		err := json.Unmarshal([]byte(in), &want)
		if got, ok := plainString([]byte(in)); ok && (err != nil || got != want) {
			t.Errorf("%q: fast %q, encoding/json %q (%v)", in, got, want, err)
		}
	}
}

func marshal(t *testing.T, v any) []byte {
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(v); err != nil {
		t.Fatal(err)
	}
	return bytes.TrimSuffix(buf.Bytes(), []byte("\n"))
}

func TestAppendJSONAgreesWithEncoder(t *testing.T) {
	values := []any{
		nil, true, false, "", "plain", "quote\" backslash\\ nl\n cr\r tab\t ctl\x01\x1f del\x7f",
		"<html> & more", "\xff\xfe bad utf-8 \xc3", "line\u2028sep\u2029", "é 😀",
		0, -1, int64(1) << 62, []string{"a", "b\n"}, []string(nil), []any{1, "x", nil, []any{}},
		[]any(nil), map[string]any(nil), json.RawMessage(`"nonce"`),
		map[string]any{"id": int64(7), "ok": true, "hello": map[string]any{
			"proto": 1, "caps": []string{"exec", "pty"}, "nonce": json.RawMessage(`"n1"`)},
			"generation": "g-1", "z": nil, "a": []any{map[string]any{"k": "v"}}},
	}
	rng := rand.New(rand.NewSource(1))
	for i := 0; i < 2000; i++ {
		b := make([]byte, rng.Intn(12))
		for j := range b {
			b[j] = byte(rng.Intn(256))
		}
		values = append(values, string(b), map[string]any{string(b): string(b)})
	}
	for _, v := range values {
		got, ok := appendJSON(nil, v, 0)
		if !ok {
			t.Errorf("%#v: not taken by the fast path", v)
			continue
		}
		if want := marshal(t, v); !bytes.Equal(got, want) {
			t.Errorf("%#v: fast %s, encoding/json %s", v, got, want)
		}
	}
	for _, v := range []any{1.5, map[string]any{"f": 0.1}, struct{}{}, json.RawMessage(`{ }`),
		map[string]string{"a": "b"}} {
		if _, ok := appendJSON(nil, v, 0); ok {
			t.Errorf("%#v: the fast path should leave it to encoding/json", v)
		}
	}
}

func TestEncodeFallsBack(t *testing.T) {
	frame, err := Encode(map[string]any{"id": int64(1), "started_at": 1.25,
		"env": map[string]string{"A": "1"}}, []byte("xy"))
	if err != nil {
		t.Fatal(err)
	}
	var d Decoder
	frames := d.Feed(frame)
	if len(frames) != 1 || string(frames[0].Payload) != "xy" ||
		string(frames[0].Header["started_at"]) != "1.25" ||
		string(frames[0].Header["env"]) != `{"A":"1"}` {
		t.Fatalf("round trip: %+v", frames)
	}
}
