// The global `Buffer` the bundle's modules use: the runtime's own where it has one (Node, Bun, Deno,
// workerd with nodejs_compat). Elsewhere the WebSocket driver installs the `buffer` package's
// (src/install-buffer.ts) before pg loads. An app that imports only httpSql never loads it, which
// keeps it small: there, a stand-in turns bytea text into plain Uint8Arrays.
const hexBytes = (hex: string) => Uint8Array.from({ length: hex.length >> 1 }, (_, i) => parseInt(hex.substr(i * 2, 2), 16))
const standIn = {
  from: (value: any, encoding?: string) =>
    typeof value !== 'string' ? Uint8Array.from(value)
    : encoding === 'hex' ? hexBytes(value)
    : Uint8Array.from(value, (c: string) => c.charCodeAt(0) & 0xff), // 'binary', as postgres-bytea asks
}

export let Buffer: typeof import('buffer').Buffer = (globalThis as any).Buffer ?? standIn

/** Replaces the stand-in (never a runtime's own Buffer). */
export function installBuffer(polyfill: typeof Buffer) {
  if (Buffer === (standIn as unknown)) Buffer = polyfill
}
