/**
 * Section "isolation": what isolation costs Postgres under transaction pooling, part by part. Each
 * candidate runs 10,000 times in front of a table read by id, in one Sync group unless said, over a
 * raw connection (no client library between), and is measured as that backend's CPU (/proc, 10 ms
 * ticks) per group, beside the read alone. Also the parser's reading of a statement, in this process.
 */
import pg from 'pg'
import { serialize } from 'pg-protocol'
import { loadReader, read } from '../proxy/isolation/reader'
import { handoverReset, verificationSql } from '../proxy/isolation/verify'
import { printGrid, type Section } from './lib'
import { cpuSecondsOf as cpuOf } from '../test/support/child-proxy'

const TEXTS = 2000
const GROUPS = 10_000
const BATCH = 50

const ext = (text: string) => Buffer.concat([serialize.parse({ text }), serialize.bind({}), serialize.execute({})])
const SYNC = serialize.sync()
const READ = Buffer.concat([ext('SELECT v FROM bench_isolation WHERE id = 42'), SYNC])
const UTILITIES = ['RESET ALL', 'CLOSE ALL', 'UNLISTEN *', 'DISCARD TEMP', 'DISCARD SEQUENCES', 'SET SESSION AUTHORIZATION DEFAULT']
/** The least a fresh question asks (temporary objects, cursors, SQL prepared statements, LISTEN), raising an error if any: planned afresh each time. */
const QUESTION = `SELECT pg_catalog.int4div(1, (NOT (EXISTS (SELECT FROM pg_catalog.pg_depend WHERE refclassid OPERATOR(pg_catalog.=) 2615 AND refobjid OPERATOR(pg_catalog.=) pg_catalog.pg_my_temp_schema())
  OR EXISTS (SELECT FROM pg_catalog.pg_cursor() c WHERE c.is_holdable) OR EXISTS (SELECT FROM pg_catalog.pg_prepared_statement() p WHERE p.from_sql)
  OR EXISTS (SELECT FROM pg_catalog.pg_listening_channels())))::pg_catalog.int4)`



export const isolation: Section = {
  name: 'isolation',
  async run(ctx) {
    await loadReader()
    const statement = (i: number) => `select "id", "name", "email" from "public"."users" where "id" = $1 and "org" = ${i} order by "name" limit $2`
    let t0 = performance.now()
    for (let i = 0; i < TEXTS; i++) read(statement(i))
    const first = ((performance.now() - t0) * 1000) / TEXTS
    t0 = performance.now()
    for (let round = 0; round < 10; round++) for (let i = 0; i < TEXTS; i++) read(statement(i))
    const cached = ((performance.now() - t0) * 1000) / (TEXTS * 10)

    const client = new pg.Client(ctx.pgConfig())
    await client.connect()
    const pid: number = (await client.query('SELECT pg_backend_pid() AS pid')).rows[0].pid
    await client.query('DROP TABLE IF EXISTS bench_isolation; CREATE TABLE bench_isolation AS SELECT g AS id, md5(g::text) AS v FROM generate_series(1, 1000) g; CREATE INDEX ON bench_isolation (id)')
    // The connection from here on is raw bytes: groups pipelined BATCH at a time, answers counted by ReadyForQuery.
    const stream = (client as any).connection.stream as import('node:net').Socket
    stream.removeAllListeners('data')
    const groups = async (group: Buffer, readies = 1) => {
      let rest: Buffer = Buffer.alloc(0)
      let due = 0
      let errors = 0
      let done = () => {}
      const onData = (chunk: Buffer) => {
        rest = rest.length ? Buffer.concat([rest, chunk]) : chunk
        let at = 0
        for (; at + 5 <= rest.length && at + 1 + rest.readInt32BE(at + 1) <= rest.length; at += 1 + rest.readInt32BE(at + 1)) {
          if (rest[at] === 0x45) errors++
          if (rest[at] === 0x5a && --due === 0) done()
        }
        rest = rest.subarray(at)
      }
      stream.on('data', onData)
      const batch = Buffer.concat(Array(BATCH).fill(group))
      const cpu = cpuOf(pid)
      for (let i = 0; i < GROUPS; i += BATCH) await new Promise<void>((resolve) => ((done = resolve), (due = BATCH * readies), stream.write(batch)))
      stream.off('data', onData)
      if (errors) throw new Error(`bench isolation: ${errors} errors`)
      return ((cpuOf(pid) - cpu) * 1e6) / GROUPS
    }
    try {
      const user = String(ctx.pgConfig().user)
      const cases: Array<[string, Buffer, number?]> = [
        // (The seed goes by a FunctionCall message, which ends in a ReadyForQuery of its own.)
        ['DISCARD ALL and a fresh seed, in the read’s group (edgepg-proxy, at a handover)', Buffer.concat([handoverReset(), READ]), 2],
        ['DISCARD ALL alone, in the read’s group', Buffer.concat([ext('DISCARD ALL'), READ])],
        ['DISCARD ALL in a group of its own after the read (PgBouncer, server_reset_query_always)', Buffer.concat([READ, ext('DISCARD ALL'), SYNC]), 2],
        ['SELECT 1 in a group of its own after the read (what any round of its own costs)', Buffer.concat([READ, ext('SELECT 1'), SYNC]), 2],
        ...UTILITIES.map((u): [string, Buffer] => [u, Buffer.concat([ext(u), READ])]),
        ['the six utility commands above, each a message', Buffer.concat([...UTILITIES.map(ext), READ])],
        ['SELECT pg_catalog.pg_advisory_unlock_all()', Buffer.concat([ext('SELECT pg_catalog.pg_advisory_unlock_all()'), READ])],
        ['the least fresh question (temp objects, cursors, SQL PREPAREs, LISTEN)', Buffer.concat([ext(QUESTION), READ])],
        ['the full account, fresh (asked after a transaction that set state)', Buffer.concat([ext(verificationSql(user)), READ])],
      ]
      await groups(READ) // (warm)
      const alone: number[] = []
      const extra = new Map<string, number[]>()
      // Twice, interleaved with the read alone, so that a busy moment weighs on each alike.
      for (let round = 0; round < 2; round++) {
        for (const [what, group, readies] of cases) {
          alone.push(await groups(READ))
          extra.set(what, [...(extra.get(what) ?? []), await groups(group, readies)])
        }
      }
      const base = alone.reduce((a, b) => a + b) / alone.length
      const over = (xs: number[]) => xs.reduce((a, b) => a + b) / xs.length - base
      printGrid(
        'isolation: what a handover and a question cost Postgres (µs of its CPU per group, over the read alone)',
        ['what', 'Postgres CPU'],
        [
          ['the read alone (a table read by id)', `${base.toFixed(1)} µs`],
          ...cases.map(([what]) => [what, `+${over(extra.get(what)!).toFixed(1)} µs`]),
          ['reading a statement with the parser, first sight (proxy)', `${first.toFixed(1)} µs`],
          ['reading it again (cached)', `${cached.toFixed(2)} µs`],
        ],
        [
          'A handover (a backend going to another session than its last) costs DISCARD ALL in the group of the next session’s first statement.',
          'Any question planned afresh (the only kind no session can answer in Postgres’s place) costs more than every reset together.',
          `${GROUPS} groups each, pipelined ${BATCH} at a time over one connection; CPU in 10 ms ticks (±1 µs here).`,
        ]
      )
      const row = (what: string) => over(extra.get(what)!).toFixed(1)
      return [
        { metric: 'handover reset, Postgres CPU (µs)', edgepg: row(cases[0][0]), baseline: row(cases[1][0]) },
        { metric: 'parse, first sight (µs)', edgepg: first.toFixed(1), baseline: '' },
      ]
    } finally {
      stream.destroy()
      await client.end().catch(() => {})
      const admin = new pg.Client(ctx.pgConfig())
      await admin.connect()
      await admin.query('DROP TABLE bench_isolation').finally(() => admin.end())
    }
  },
}
