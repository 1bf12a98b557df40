package wire

import (
	"encoding/json"
	"testing"
)

func header(t *testing.T, s string) Header {
	var h Header
	if err := json.Unmarshal([]byte(s), &h); err != nil {
		t.Fatal(err)
	}
	return h
}

func TestGettersReadFieldsAsPythonDid(t *testing.T) {
	h := header(t, `{"id": 7, "f": 2.9, "s": "12", "z": 0, "e": "", "o": {}, "n": null,
		"t": true, "obj": {"a": 1}, "bad": "x"}`)
	if id, ok := h.ID(); !ok || id != 7 {
		t.Fatalf("id %v %v", id, ok)
	}
	if _, ok := header(t, `{"id": 1.5}`).ID(); ok {
		t.Fatal("a float id is not a request id")
	}
	if v, _, err := h.Int("f"); err != nil || v != 2 {
		t.Fatalf("int(2.9) = %v %v", v, err)
	}
	if v, _, err := h.Int("s"); err != nil || v != 12 {
		t.Fatalf("int('12') = %v %v", v, err)
	}
	if _, _, err := h.Int("bad"); err == nil {
		t.Fatal("int('x') must fail")
	}
	for key, want := range map[string]bool{"z": false, "e": false, "o": false, "n": false,
		"missing": false, "t": true, "obj": true, "f": true} {
		if h.Truthy(key) != want {
			t.Fatalf("truthy(%s) != %v", key, want)
		}
	}
	if !h.Has("n") || h.Has("missing") {
		t.Fatal("Has")
	}
	if PyStr(h["t"]) != "True" || PyStr(h["n"]) != "None" || PyRepr(h["bad"]) != "'x'" {
		t.Fatal("PyStr/PyRepr")
	}
}
