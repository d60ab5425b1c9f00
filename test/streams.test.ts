/**
 * Streams on edgepg, through edgepg-proxy with warm backends on: pg-copy-streams (100 MB COPY FROM
 * STDIN and back out, byte for byte, an error in the middle of one), pg-query-stream and pg-cursor
 * (a million rows). Each big run is a child process (test/support/streams-client.ts) whose peak RSS is
 * its own: the socket must push back on the writer (write() false, then 'drain') and stop reading
 * while the reader is paused, or the 100 MB (or the million rows) pile up in the client.
 */
import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { execFile } from 'node:child_process'
import { promisify } from 'node:util'
import { Readable } from 'node:stream'
import { pipeline } from 'node:stream/promises'
import { from as copyFrom, to as copyTo } from 'pg-copy-streams'
import { startProxy, edgeClient, within } from './support/helpers'

const run = promisify(execFile)
/**
 * Peak RSS growth allowed while streaming: well under the 100 MB that goes through. (Measured: about
 * 20-40 MiB; 186 MiB when the socket kept reading for a paused reader, 258 MiB when write() never said wait.)
 */
const MEMORY_BOUND = 48 * 1024 * 1024
const MiB = (bytes: number) => `${(bytes / 1024 / 1024).toFixed(1)} MiB`

let proxy: Awaited<ReturnType<typeof startProxy>>
before(async () => (proxy = await startProxy()))
after(() => proxy?.close())

async function streamInChild(mode: 'copy' | 'query-stream' | 'cursor') {
  const { stdout } = await run(process.execPath, ['--max-old-space-size=40', '--import', 'tsx', 'test/support/streams-client.ts', mode, String(proxy.port)], { timeout: 150_000, maxBuffer: 1 << 20 })
  return JSON.parse(stdout.trim().split('\n').pop()!)
}

test('COPY FROM STDIN of 100 MB and COPY TO STDOUT back, byte-identical, in bounded memory (pg-copy-streams)', async (t) => {
  const r = await streamInChild('copy')
  t.diagnostic(`${r.rowsIn} rows in, ${MiB(r.receivedBytes)} back out; peak RSS growth ${MiB(r.peakGrowth)}`)
  assert.ok(r.rowsIn > 900_000, `COPY reported ${r.rowsIn} rows`)
  assert.equal(r.rowsInTable, r.rowsIn)
  assert.ok(r.receivedBytes >= 100 * 1024 * 1024, `got ${r.receivedBytes} bytes back`)
  assert.equal(r.receivedSha, r.sentSha, 'COPY TO STDOUT gives back exactly the bytes COPY FROM STDIN took')
  assert.equal(r.answer, 42, 'the connection serves queries after the COPYs')
  assert.ok(r.peakGrowth < MEMORY_BOUND, `the client's peak RSS grew by ${MiB(r.peakGrowth)} (bound ${MiB(MEMORY_BOUND)})`)
})

for (const mode of ['query-stream', 'cursor'] as const) {
  test(`a million rows through ${mode === 'cursor' ? 'pg-cursor' : 'pg-query-stream'} in bounded memory`, async (t) => {
    const r = await streamInChild(mode)
    t.diagnostic(`${r.rows} rows; peak RSS growth ${MiB(r.peakGrowth)}`)
    assert.equal(r.rows, 1_000_000)
    assert.equal(r.sum, (1_000_000 * 1_000_001) / 2)
    assert.equal(r.answer, 42)
    assert.ok(r.peakGrowth < MEMORY_BOUND, `the client's peak RSS grew by ${MiB(r.peakGrowth)} (bound ${MiB(MEMORY_BOUND)})`)
  })
}

test('an error in the middle of a COPY leaves the connection usable, and nothing of that COPY in the table', async () => {
  const client = edgeClient(proxy.port)
  await client.connect()
  let pid: number | undefined
  try {
    await client.query('CREATE TEMP TABLE copy_err (id int, name text)')
    const good = (from: number, n: number) => Array.from({ length: n }, (_, i) => `${from + i}\tname ${from + i}\n`).join('')

    // Postgres refuses a line after ~1 MB: its ErrorResponse fails the stream.
    const bad = Readable.from([good(1, 50_000), 'not a number\toops\n', good(50_001, 1000)])
    const refused = await within(30_000, 'the refused COPY', pipeline(bad, client.query(copyFrom('COPY copy_err FROM STDIN'))).then(() => undefined, (err) => err))
    assert.equal(refused?.code, '22P02', `Postgres's own error comes back: ${refused?.message}`)
    assert.match(refused.message, /invalid input syntax for type integer/)

    // The source fails half-way: the COPY is given up (CopyFail) and Postgres says so.
    const failing = new Readable({ read() {} })
    failing.push(good(1, 10_000))
    setTimeout(() => failing.destroy(new Error('the source broke')), 50)
    const abandoned = await within(30_000, 'the abandoned COPY', pipeline(failing, client.query(copyFrom('COPY copy_err FROM STDIN'))).then(() => undefined, (err) => err))
    assert.match(String(abandoned?.message), /the source broke/)

    const { rows } = await client.query('SELECT count(*)::int AS n FROM copy_err')
    assert.equal(rows[0].n, 0, 'neither COPY left a row')
    await pipeline(Readable.from([good(1, 3)]), client.query(copyFrom('COPY copy_err FROM STDIN')))
    const chunks: Buffer[] = []
    await pipeline(client.query(copyTo('COPY copy_err TO STDOUT')), async function* (source) {
      for await (const chunk of source) chunks.push(chunk)
    })
    assert.equal(Buffer.concat(chunks).toString(), good(1, 3), 'a COPY after the errors works')
    pid = (await client.query('SELECT pg_backend_pid() AS pid')).rows[0].pid
  } finally {
    await client.end()
  }
  // Warm backends are on: the backend went back to the pool after all that, and serves the next session.
  const next = edgeClient(proxy.port)
  await next.connect()
  try {
    assert.equal((await next.query('SELECT pg_backend_pid() AS pid')).rows[0].pid, pid, 'the next session gets the same (warm) backend')
  } finally {
    await next.end()
  }
})
