package wire

import (
	"bytes"
	"encoding/json"
	"testing"
)

func TestRoundTripAndResync(t *testing.T) {
	a, err := Encode(map[string]any{"id": 1, "op": "ping"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := Encode(map[string]any{"id": 2, "event": "stdout", "s": "<&>"}, []byte("hello"))
	if !bytes.Contains(b, []byte(`"<&>"`)) {
		t.Fatalf("HTML escaping in %q", b)
	}
	// Garbage, a torn frame start and a bogus length before real frames.
	junk := append([]byte("xx\xa5SL"), Magic...)
	junk = append(junk, 0xff, 0xff, 0xff, 0xff, 0, 0, 0, 0)
	stream := append(append(junk, a...), b...)
	var d Decoder
	var got []Frame
	for i := 0; i < len(stream); i += 3 { // byte by byte-ish: frames split anywhere
		end := i + 3
		if end > len(stream) {
			end = len(stream)
		}
		got = append(got, d.Feed(stream[i:end])...)
	}
	if len(got) != 2 {
		t.Fatalf("got %d frames", len(got))
	}
	var id int
	if err := json.Unmarshal(got[1].Header["id"], &id); err != nil || id != 2 {
		t.Fatalf("id %v %v", id, err)
	}
	if string(got[1].Payload) != "hello" || d.Skipped == 0 {
		t.Fatalf("payload %q skipped %d", got[1].Payload, d.Skipped)
	}
}

func TestCapsAndNonObjects(t *testing.T) {
	if _, err := Encode(map[string]any{}, make([]byte, MaxPayload+1)); err != ErrTooLarge {
		t.Fatalf("oversized payload: %v", err)
	}
	// A header that is JSON but not an object is skipped like garbage.
	bad := append(append([]byte{}, Magic...), 0, 0, 0, 2, 0, 0, 0, 0)
	bad = append(bad, "[]"...)
	good, _ := Encode(map[string]any{"id": 3}, nil)
	var d Decoder
	if frames := d.Feed(append(bad, good...)); len(frames) != 1 {
		t.Fatalf("got %d frames", len(frames))
	}
}
