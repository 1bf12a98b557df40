// Package wire is the framing of the host <-> guest agent channel, as in
// src/sandlot/guest/wire.py (the host's end):
//
//	MAGIC (4 bytes) | header_len (u32 BE) | payload_len (u32 BE) | header | payload
//
// where the header is a UTF-8 JSON object. Both ends treat the peer as hostile: lengths are
// capped before anything is allocated, and a reader that meets bytes that are not a frame start
// (left over from a connection that dropped mid-frame, or a VM restored from a snapshot taken
// mid-write) skips ahead to the next MAGIC.
package wire

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
)

// Magic starts every frame.
var Magic = []byte("\xa5SL1")

// Why these caps: a header is a small JSON object (the largest is an env map); payloads are
// file chunks and output chunks, which senders split at ChunkSize.
const (
	MaxHeader  = 1 << 20
	MaxPayload = 4 << 20
	ChunkSize  = 1 << 20
	PrefixSize = 12
)

// ErrTooLarge: a frame that exceeds the caps (the peer would refuse it).
var ErrTooLarge = errors.New("frame too large")

// Header is a decoded frame header: its fields as raw JSON, read with the typed getters.
type Header map[string]json.RawMessage

// Frame is one decoded frame.
type Frame struct {
	Header  Header
	Payload []byte
}

// Encode serializes one frame; header values are marshalled as JSON (no HTML escaping).
func Encode(header any, payload []byte) ([]byte, error) {
	out, ok := appendJSON(make([]byte, PrefixSize, PrefixSize+256+len(payload)), header, 0)
	if !ok { // a type the fast path does not take: encoding/json
		var head bytes.Buffer
		enc := json.NewEncoder(&head)
		enc.SetEscapeHTML(false)
		if err := enc.Encode(header); err != nil {
			return nil, err
		}
		out = append(out[:PrefixSize], bytes.TrimSuffix(head.Bytes(), []byte("\n"))...)
	}
	hlen := len(out) - PrefixSize
	if hlen > MaxHeader || len(payload) > MaxPayload {
		return nil, ErrTooLarge
	}
	copy(out, Magic)
	binary.BigEndian.PutUint32(out[4:8], uint32(hlen))
	binary.BigEndian.PutUint32(out[8:12], uint32(len(payload)))
	return append(out, payload...), nil
}

// Decoder is incremental: Feed bytes, get back the complete frames.
type Decoder struct {
	buf     []byte
	Skipped int
}

// Reset drops partial input (the host went away mid-frame).
func (d *Decoder) Reset() { d.buf = d.buf[:0] }

// Feed appends data and returns every complete frame it finishes.
func (d *Decoder) Feed(data []byte) []Frame {
	d.buf = append(d.buf, data...)
	var frames []Frame
	off := 0
	defer func() { d.buf = d.buf[:copy(d.buf, d.buf[off:])] }()
	for {
		buf := d.buf[off:]
		start := bytes.Index(buf, Magic)
		if start < 0 {
			// Keep a possible partial MAGIC at the end.
			if drop := len(buf) - (len(Magic) - 1); drop > 0 {
				d.Skipped += drop
				off += drop
			}
			return frames
		}
		d.Skipped += start
		off += start
		buf = buf[start:]
		if len(buf) < PrefixSize {
			return frames
		}
		hlen := binary.BigEndian.Uint32(buf[4:8])
		plen := binary.BigEndian.Uint32(buf[8:12])
		if hlen > MaxHeader || plen > MaxPayload || hlen == 0 {
			off++ // not a real frame start: resync
			continue
		}
		total := PrefixSize + int(hlen) + int(plen)
		if len(buf) < total {
			return frames
		}
		header, ok := splitObject(buf[PrefixSize : PrefixSize+int(hlen)])
		if !ok {
			if err := json.Unmarshal(buf[PrefixSize:PrefixSize+int(hlen)], &header); err != nil ||
				header == nil {
				off++
				continue
			}
		}
		payload := append([]byte(nil), buf[PrefixSize+int(hlen):total]...)
		off += total
		frames = append(frames, Frame{Header: header, Payload: payload})
	}
}
