/**
 * Run by streams.test.ts as a child process, so that its peak memory (VmHWM) is a client's own:
 *
 *   node --max-old-space-size=40 --import tsx test/support/streams-client.ts <copy|query-stream|cursor> <proxy port>
 *
 * (A small heap, so that V8 collects garbage as it goes: what stays is what is held. Buffers live
 * outside the heap: held data still shows in the RSS, whatever the heap's size.)
 *
 * Streams through edgepg-proxy with pg-copy-streams, pg-query-stream or pg-cursor, then prints one
 * JSON line: what went through, and the peak RSS over the RSS before streaming.
 */
import { createHash } from 'node:crypto'
import { readFileSync } from 'node:fs'
import { Readable, Writable } from 'node:stream'
import { pipeline } from 'node:stream/promises'
import Cursor from 'pg-cursor'
import QueryStream from 'pg-query-stream'
import { from as copyFrom, to as copyTo } from 'pg-copy-streams'
import { edgeClient } from './helpers'

const [mode, port] = process.argv.slice(2)
const COPY_BYTES = 100 * 1024 * 1024
const STREAM_ROWS = 1_000_000

const peakRss = () => Number(/^VmHWM:\s+(\d+) kB$/m.exec(readFileSync('/proc/self/status', 'utf8'))![1]) * 1024

/** `id\tpayload\n` lines in COPY's text format, `bytes` in all, made as they are read (never held whole). */
function lines(bytes: number, hash: ReturnType<typeof createHash>) {
  let sent = 0
  let id = 0
  return new Readable({
    read() {
      if (sent >= bytes) return void this.push(null)
      const parts: string[] = []
      let size = 0
      while (size < 64 * 1024 && sent + size < bytes) {
        const line = `${++id}\t${'abcdefghijklmnopqrstuvwxyz'.repeat(4)}${id % 997}\n`
        parts.push(line)
        size += line.length
      }
      const chunk = Buffer.from(parts.join(''))
      sent += chunk.length
      hash.update(chunk)
      this.push(chunk)
    },
  })
}

/** A consumer slower than the network (25 MB/s), hashing what it gets: the reading side must wait for it. */
const slowHasher = (hash: ReturnType<typeof createHash>, counted: { bytes: number }) =>
  new Writable({
    write(chunk: Buffer, _encoding, done) {
      hash.update(chunk)
      counted.bytes += chunk.length
      setTimeout(done, chunk.length / 25_000) // 25 MB/s
    },
  })

const client = edgeClient(Number(port))
await client.connect()
const before = process.memoryUsage.rss()
let result: Record<string, unknown>
if (mode === 'copy') {
  await client.query('DROP TABLE IF EXISTS copy_big; CREATE TABLE copy_big (id int, payload text)')
  const sentHash = createHash('sha256')
  const source = lines(COPY_BYTES, sentHash)
  const upload = client.query(copyFrom('COPY copy_big FROM STDIN'))
  await pipeline(source, upload)
  const rowsIn = upload.rowCount
  const gotHash = createHash('sha256')
  const received = { bytes: 0 }
  await client.query('SET synchronize_seqscans = off') // the table's rows come back in the order they went in
  await pipeline(client.query(copyTo('COPY copy_big TO STDOUT')), slowHasher(gotHash, received))
  const { rows } = await client.query('SELECT count(*)::int AS n FROM copy_big')
  result = { rowsIn, rowsInTable: rows[0].n, sentSha: sentHash.digest('hex'), receivedSha: gotHash.digest('hex'), receivedBytes: received.bytes }
  await client.query('DROP TABLE copy_big')
} else {
  const sql = `SELECT g AS id, md5(g::text) AS hash FROM generate_series(1, ${STREAM_ROWS}) g`
  let rows = 0
  let sum = 0
  if (mode === 'query-stream') {
    const stream = client.query(new QueryStream(sql, [], { batchSize: 1000 }))
    for await (const row of stream as AsyncIterable<{ id: number; hash: string }>) {
      rows++
      sum += row.id
    }
  } else {
    const cursor = client.query(new Cursor(sql))
    for (;;) {
      const batch: Array<{ id: number }> = await cursor.read(1000)
      if (!batch.length) break
      rows += batch.length
      for (const row of batch) sum += row.id
    }
    await cursor.close()
  }
  result = { rows, sum }
}
// The connection is still in order.
const { rows: after } = await client.query('SELECT 41 + 1 AS answer')
await client.end()
console.log(JSON.stringify({ ...result, answer: after[0].answer, peakGrowth: peakRss() - before }))
