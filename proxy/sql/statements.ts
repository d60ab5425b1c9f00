/**
 * Statements on one backend, for POST /sql: each is answered in order, and those sent in the same
 * tick leave in one write (a ping, a SET, the statement and the reset behind it: one round trip),
 * every value comes back as the text Postgres sent. A statement runs with the extended protocol, as Neon's server runs it (one statement per
 * query), and ends with its ReadyForQuery, whose status is kept.
 */
import { DatabaseError, serialize } from 'pg-protocol'
import { Parser } from 'pg-protocol/dist/parser'
import type { BackendMessage, CommandCompleteMessage, DataRowMessage, ReadyForQueryMessage, RowDescriptionMessage } from 'pg-protocol/dist/messages'
import type { Upstream } from '../upstream/connection'
import { handoverReset, HANDOVER_ENDS } from '../isolation/verify'

export interface Field {
  name: string
  dataTypeID: number
  tableID: number
  columnID: number
  dataTypeSize: number
  dataTypeModifier: number
}

export interface Outcome {
  /** The command tag's verb (null where there is none), and its row count (null where it has none), as pg reads them. */
  command: string | null
  rowCount: number | null
  fields: Field[]
}

export type RowHandler = (row: Array<string | null>, fields: Field[]) => void

/** pg's reading of a command tag: `INSERT 0 5`, `SELECT 3`, `CREATE TABLE`. */
const COMMAND_TAG = /^([A-Za-z]+)(?: (\d+))?(?: (\d+))?/
/** What pg-protocol makes of a FunctionCallResponse ('V'), which it does not read. */
const FUNCTION_RESULT = 'received invalid response: 56'
const SYNC = serialize.sync()
/**
 * What pg answers a COPY FROM STDIN it has no stream for; and a Sync, as Postgres ignored the one
 * sent with the statement while it waited for the data.
 */
const NO_COPY_SOURCE = Buffer.concat([serialize.copyFail('No source stream defined'), SYNC])
const DESCRIBE_PORTAL = serialize.describe({ type: 'P' })
const EXECUTE = serialize.execute({})

interface Step {
  /** In a group of several (see grouping): answered by its CommandComplete, or skipped after an error. */
  grouped?: boolean
  outcome: Outcome
  error?: DatabaseError
  onRow?: RowHandler
  resolve(outcome: Outcome): void
  reject(err: Error): void
}

export class Statements {
  /** The last ReadyForQuery's status: 'I' idle, 'T' in a transaction, 'E' in a failed one. */
  status = 'I'
  /** The connection broke: every statement fails with this from now on. */
  broken?: Error
  /** ReadyForQuery messages received: none means nothing sent here has run. */
  answered = 0
  /** Postgres refused the reset of a backend that changed hands (see handOver): what rode behind it did not run, and the backend serves no one. */
  refused?: DatabaseError
  /** Answers still to end the reset (HANDOVER_ENDS; all it answers is no step's). */
  private handingOver = 0
  /**
   * While true, statements go without a Sync of their own: one group, which sync() ends (a batch:
   * Postgres skips everything behind its first error, the reset's too). The group's first error.
   */
  grouping = false
  private groupError?: DatabaseError
  private readonly steps: Step[] = []
  private out: Buffer[] = []
  private readonly parser = new Parser()
  private readonly onClose = () => this.fail(new Error('Connection terminated unexpectedly'))

  constructor(private readonly upstream: Upstream) {
    const onData = (chunk: Buffer) => this.parser.parse(chunk, this.onMessage)
    const early = upstream.relay(onData)
    upstream.on('close', this.onClose)
    upstream.resume()
    if (early.length) onData(early)
    if (upstream.closed) this.onClose()
  }

  /**
   * A statement with the extended protocol; `onRow` sees each row as it arrives. A COPY FROM STDIN
   * is refused (no data comes over HTTP): nothing may be sent behind one, as Postgres would take it
   * for the data.
   */
  execute(text: string, values: Array<string | null>, onRow?: RowHandler): Promise<Outcome> {
    const parts = [serialize.parse({ text }), serialize.bind({ values }), DESCRIBE_PORTAL, EXECUTE]
    if (!this.grouping) parts.push(SYNC)
    return this.send(Buffer.concat(parts), onRow)
  }

  /** One statement of the proxy's own (BEGIN, SET…): with the simple protocol, or in the group (see grouping). */
  query(text: string): Promise<Outcome> {
    return this.send(this.grouping ? Buffer.concat([serialize.parse({ text }), serialize.bind({}), EXECUTE]) : serialize.query(text))
  }

  /** A Sync: answered at once by a live backend (its ReadyForQuery says nothing sent after it ran before). */
  sync(): Promise<Outcome> {
    return this.send(SYNC)
  }

  /** Messages of the proxy's own, ending in one Sync: answered as one statement (each row's values to `onRow`). */
  own(bytes: Buffer, onRow?: RowHandler): Promise<Outcome> {
    return this.send(bytes, onRow)
  }

  /**
   * Messages of the proxy's own go next, in one Sync group with what is sent behind them, which
   * Postgres skips if it refuses them (`refused` then says why): `ends` of their answers end in a
   * CommandComplete or a ReadyForQuery. As the reset of a backend that changed hands
   * (proxy/isolation/verify.ts handoverReset), or a token's claims on a standby.
   */
  lead(bytes: Buffer, ends: number) {
    this.handingOver += ends
    if (this.out.push(bytes) === 1) queueMicrotask(this.flush)
  }

  /** The backend changed hands: its reset leads (see lead). */
  handOver() {
    this.lead(handoverReset(), HANDOVER_ENDS)
  }

  /** The stream goes back to its owner: nothing of it is read here any more. */
  detach() {
    this.upstream.off('close', this.onClose)
  }

  private send(bytes: Buffer, onRow?: RowHandler): Promise<Outcome> {
    if (this.broken) return Promise.reject(this.broken)
    const grouped = this.grouping
    return new Promise((resolve, reject) => {
      this.steps.push({ grouped, outcome: { command: null, rowCount: null, fields: [] }, onRow, resolve, reject })
      if (this.out.push(bytes) === 1) queueMicrotask(this.flush)
    })
  }

  private readonly flush = () => {
    const out = this.out
    this.out = []
    this.upstream.write(out.length === 1 ? out[0] : Buffer.concat(out))
  }

  private readonly onMessage = (msg: BackendMessage) => {
    const step = this.steps[0]
    if (!step) return // a notice or a changed setting between statements
    // (pg-protocol reads no FunctionCallResponse, the answer to the proxy's reseed: it says so, and that is no error.)
    if (msg.name === 'error' && (msg as DatabaseError).message === FUNCTION_RESULT) return
    if (this.handingOver) {
      if (msg.name === 'error') (this.handingOver = 0), (this.refused = msg as DatabaseError), (this.groupError = step.error ??= this.refused)
      else if (msg.name === 'commandComplete' || msg.name === 'readyForQuery') this.handingOver--
      return
    }
    switch (msg.name) {
      case 'rowDescription':
        step.outcome.fields = (msg as RowDescriptionMessage).fields.map(({ name, dataTypeID, tableID, columnID, dataTypeSize, dataTypeModifier }) => ({
          name, dataTypeID, tableID, columnID, dataTypeSize, dataTypeModifier,
        }))
        break
      case 'dataRow':
        step.onRow?.((msg as DataRowMessage).fields, step.outcome.fields)
        break
      case 'commandComplete': {
        const { text } = msg as CommandCompleteMessage
        const match = COMMAND_TAG.exec(text)
        if (match) {
          step.outcome.command = match[1]
          if (match[2]) step.outcome.rowCount = Number(match[3] ?? match[2])
        }
        if (step.grouped) this.steps.shift(), step.resolve(step.outcome)
        break
      }
      case 'emptyQuery':
        if (step.grouped) this.steps.shift(), step.resolve(step.outcome)
        break
      case 'error':
        step.error ??= msg as DatabaseError
        if (step.grouped) this.steps.shift(), step.reject((this.groupError ??= step.error))
        break
      case 'copyInResponse':
        this.upstream.write(NO_COPY_SOURCE)
        break
      case 'readyForQuery': {
        this.status = (msg as ReadyForQueryMessage).status
        this.answered++
        // (What is left of a group was skipped after its first error.)
        while (this.steps[0]?.grouped) this.steps.shift()!.reject(this.groupError ?? new Error('skipped'))
        const sync = this.steps.shift()!
        this.groupError = undefined
        sync.error ? sync.reject(sync.error) : sync.resolve(sync.outcome)
        break
      }
    }
  }

  private fail(err: Error) {
    this.broken ??= err
    for (const step of this.steps.splice(0)) step.reject(err)
  }
}
