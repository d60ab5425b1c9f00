// A fresh Client's first read and a warm read, timed inside the runtime that runs this (Node, Bun,
// Deno), on the built bundle; bench/regions.ts runs it through B with the replica. It writes once
// first, so that each fresh Client tells the position (config.lastWrite) with its query, as a
// request carrying it in a cookie would. Args: the proxy's URL, a connection string, the read,
// the write, runs. Prints {"fresh": ms, "warm": ms}, medians.
import { Client } from '../dist/index.mjs'

const [wsUrl, connectionString, read, write, runs] = globalThis.Deno ? Deno.args : process.argv.slice(2)
const webSocketConstructor = globalThis.WebSocket ? undefined : (await import('ws')).WebSocket // (Node 20 has none of its own)
const client = () => new Client({ connectionString, wsProxy: () => wsUrl, ...(webSocketConstructor && { webSocketConstructor }) })
const median = (xs) => xs.sort((a, b) => a - b)[xs.length >> 1]

const writer = client()
await writer.connect()
await writer.query(write)
await writer.end()
const fresh = []
for (let i = 0; i < 5 + Number(runs); i++) {
  const c = client()
  const t0 = performance.now()
  await c.connect()
  await c.query(read)
  if (i >= 5) fresh.push(performance.now() - t0)
  await c.end()
}
const c = client()
await c.connect()
await c.query(read)
const warm = []
for (let i = 0; i < Number(runs); i++) {
  const t0 = performance.now()
  await c.query(read)
  warm.push(performance.now() - t0)
}
await c.end()
console.log(JSON.stringify({ fresh: median(fresh), warm: median(warm) }))
